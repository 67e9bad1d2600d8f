"""A stand-in for `ingero trace` that the real agent server starts (no root, no eBPF).

    python fake_tracer.py --ranks 0,1 --pods P --node N --segments DIR --session-id S \
        --ready-file F --done-file F [any other `ingero trace` flag]

It writes the trace_fixture job's segments for its ranks through the real
segment store (rank 3 arrives late at every ALL_REDUCE and retransmits),
touches the ready file, waits for SIGINT or SIGTERM as a tracer does, then
touches the done file and exits 0. The agent, the operator, the API server
and the analysis around it are the real ones.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.unit.trace_fixture import write_node  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--segments", type=Path, required=True)
    p.add_argument("--session-id", required=True)
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--done-file", type=Path, required=True)
    p.add_argument("--steps", type=int, default=100)   # the live verdict waits for >= 40 steps
    args, _ = p.parse_known_args()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: None)    # a re-plan: nothing to re-read here
    if not any(args.segments.rglob("*.parquet")):    # a restarted tracer keeps its segments
        write_node(args.segments, args.node, [int(r) for r in args.ranks.split(",")], steps=args.steps,
                   session=args.session_id)
    args.ready_file.touch()
    while not stop.wait(0.1):
        pass
    args.done_file.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
