"""Step-time overhead of tracing: the lab workload with every probe on vs none.

    python -m bench.step_overhead [--rounds 3] [--seconds 8]

Runs the clean lab scenario (2 nodes x 2 ranks) alternately without and with
`--trace` (all probes: nccl, tcp, sched; one tracer per lab node), so both
see the same machine noise, and compares the job's mean step time. Needs root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(out: Path, seconds: float, trace: bool) -> float:
    cmd = [sys.executable, "-m", "ingero", "lab", "run", "--scenario", "clean",
           "--seconds", str(seconds), "--out", str(out)] + (["--trace"] if trace else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lab = json.loads((out / "lab.json").read_text())
    return statistics.fmean(r["stats"]["mean_step_ms"] for r in lab["ranks"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    a = ap.parse_args(argv)
    off, on = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.rounds):
            off.append(one_run(Path(d) / f"off{i}", a.seconds, trace=False))
            on.append(one_run(Path(d) / f"on{i}", a.seconds, trace=True))
    r = {"untraced_ms": statistics.median(off), "traced_ms": statistics.median(on),
         "rounds": a.rounds, "untraced_all": off, "traced_all": on}
    r["overhead_pct"] = 100.0 * (r["traced_ms"] / r["untraced_ms"] - 1.0)
    print(f"step overhead: untraced {r['untraced_ms']:.2f} ms, traced {r['traced_ms']:.2f} ms "
          f"(median of {a.rounds} alternating runs) = {r['overhead_pct']:+.2f}% (target <= 1%)")
    return r


if __name__ == "__main__":
    main()
