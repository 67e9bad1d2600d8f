"""How long a lab run's tracers take to stop, by how the tracer attaches its probes.

    python -m bench.tracer_stop [--runs 3] [--setups perf,links,raw]
                                [--layout tp=2,pp=2,dp=2 --nodes 2 --ranks-per-node 4]

Runs `ingero lab run --trace` (every probe family; a tracer per lab node) round
after round, alternating the set-ups, so they share the machine's load:
"raw" (the default where the kernel has them: NCCL uprobes as uprobe_multi links,
TCP and scheduler tracepoints as raw tracepoints: no perf event at all), "links"
(INGERO_RAW_TRACEPOINTS=0: the tracepoints as perf events, as on a kernel before
6.1) and "perf" (INGERO_UPROBE_MULTI=0 as well: one perf event per uprobe too, as
on a kernel older than 6.6). Reported per set-up, median over the runs: the lab
run's wall time and the slowest tracer's "probes detached in" (from its log).
Needs root.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import need_root

SETUPS = {"perf": {"INGERO_UPROBE_MULTI": "0", "INGERO_RAW_TRACEPOINTS": "0"},
          "links": {"INGERO_RAW_TRACEPOINTS": "0"}, "raw": {}}
DETACHED = re.compile(r"probes detached in ([0-9.]+) s")


def one_run(setup: str, lab_args: list[str], out: Path) -> dict:
    env = dict(os.environ, **SETUPS[setup])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ingero", "lab", "run", "--trace", "--out", str(out), *lab_args],
                       env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"lab run ({setup}) failed ({r.returncode}):\n{r.stderr[-3000:]}")
    detached = [float(m.group(1)) for log in sorted((out / "nodes").glob("*.tracer.log"))
                for m in DETACHED.finditer(log.read_text())]
    if not detached:
        sys.exit(f"no 'probes detached' line in the tracer logs of {out / 'nodes'}")
    return {"wall_s": wall, "detach_s": max(detached), "tracers": len(detached)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    args, lab_args = ap.parse_known_args(argv)
    setups = args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        sys.exit(f"unknown set-up {', '.join(unknown)}: choose from {', '.join(SETUPS)}")
    need_root("bench.tracer_stop")
    results: dict[str, list[dict]] = {s: [] for s in setups}
    top = Path(tempfile.mkdtemp(prefix="ingero-tracer-stop-"))
    try:
        for i in range(args.runs):
            for setup in setups:
                r = one_run(setup, lab_args, top / f"{setup}-{i}")
                results[setup].append(r)
                print(f"run {i + 1} {setup:5s}: lab {r['wall_s']:.1f} s, slowest of {r['tracers']} tracers "
                      f"detached in {r['detach_s']:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    medians = {setup: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "detach_s")}
               for setup, rs in results.items()}
    for setup, m in medians.items():
        print(f"{setup:5s}: lab run {m['wall_s']:.1f} s, probes detached in {m['detach_s']:.2f} s "
              f"(medians of {args.runs})")
    return medians


if __name__ == "__main__":
    main()
