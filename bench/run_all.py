"""Run every benchmark once, side by side on this machine, and save the figures.

    python -m bench.run_all [--quick] [--out bench/results.json]

`make bench` runs this. The figures quoted in docs/benchmarks.md come from
its output; each benchmark compares its set-ups within one run (alternating
rounds where noise matters) and reports ratios, because these machines are
noisy. Root is needed for the eBPF ones; they are skipped with the reason
otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--out", type=Path, default=Path("bench/results.json"))
    a = ap.parse_args(argv)
    from bench import (analysis_scale, duration_encoding, ingest, live_refresh, profiler_cost, sqlite_vs_duckdb,
                       step_overhead, storage, time_to_straggler, tracer_stop, uprobe_cost)

    q = a.quick
    plan = [
        ("storage", storage.main, ["--events", "200000" if q else "2000000"]),
        ("sqlite_vs_duckdb", sqlite_vs_duckdb.main,
         ["--events", "300000", "--sqlite-cap", "10"] if q else []),
        ("analysis_scale", analysis_scale.main, ["--quick"] if q else []),
        ("live_refresh", live_refresh.main, ["--quick"] if q else []),
        ("duration_encoding", duration_encoding.main, ["--rows", "1000000"] if q else []),
    ]
    root = [
        ("uprobe_cost", uprobe_cost.main, ["--rounds", "3"] if q else []),
        ("profiler_cost", profiler_cost.main, ["--rounds", "3", "--ops", "100000"] if q else []),
        ("ingest", ingest.main, ["--rates", "1000000", "--seconds", "2"] if q else []),
        ("step_overhead", step_overhead.main,
         ["--device", "cpu,gpu"] + (["--rounds", "1", "--seconds", "4"] if q else [])),
        ("tracer_stop", tracer_stop.main, ["--runs", "1" if q else "3"]),
        ("time_to_straggler", time_to_straggler.main,
         ["--quick"] if q else ["--faults", "lossy-link,slow-rank,cpu-hog,io-stall"]),
    ]
    results = {"machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                           "when": time.strftime("%Y-%m-%d %H:%M:%S")}}
    for name, fn, args in plan + root:
        if (name, fn, args) in root and os.geteuid() != 0:
            results[name] = {"skipped": "needs root (eBPF)"}
            print(f"{name}: skipped: needs root (eBPF)")
            continue
        t = time.perf_counter()
        results[name] = fn(args)
        print(f"  ({name} took {time.perf_counter() - t:.0f} s)")
    a.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"results in {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
