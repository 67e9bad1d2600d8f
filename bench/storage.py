"""Bytes per event on disk: NCCL-shaped events through the real segment writer.

    python -m bench.storage [--events 2000000] [--roll-events 200000]

Segments are rolled the way the agent rolls them (every ~2 s of a busy node:
`--roll-events` rows per segment), then every Parquet file is summed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.synthetic import as_agent_columns, nccl_columns
from ingero.store import SegmentWriter


def measure(events: int, roll_events: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        w = SegmentWriter(Path(d), node="node-a", session_id="bench")
        cols = as_agent_columns(nccl_columns(events))
        t = time.perf_counter()
        for lo in range(0, events, roll_events):
            w.append("nccl_events", {k: v[lo:lo + roll_events] for k, v in cols.items()})
            w.flush()
        secs = time.perf_counter() - t
        size = sum(f.stat().st_size for f in Path(d).rglob("nccl_events/*.parquet"))
        return {"events": events, "segments": w.segments_written, "bytes": size,
                "bytes_per_event": size / events, "write_events_per_s": events / secs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--roll-events", type=int, default=200_000)
    a = ap.parse_args(argv)
    r = measure(a.events, a.roll_events)
    print(f"storage: {r['events']:,} NCCL events in {r['segments']} segments = {r['bytes']:,} B, "
          f"{r['bytes_per_event']:.2f} B/event (target <= 16); writer {r['write_events_per_s']:,.0f} events/s")
    return r


if __name__ == "__main__":
    main()
