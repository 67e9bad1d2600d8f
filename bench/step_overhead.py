"""Step-time overhead of tracing: the lab workload with every probe on vs none.

    python -m bench.step_overhead [--rounds 3] [--seconds 8] [--device cpu,gpu] [--baseline DIR]

Runs the clean lab scenario (2 nodes x 2 ranks) alternately without and with
`--trace` (all probes: nccl, tcp, sched; one tracer per lab node), so both
see the same machine noise, and compares the job's mean step time: the
median of each set, and the median of the per-round ratios (traced over the
untraced run just before it), which drifting load on a shared machine
disturbs less. `--device gpu`: the lab's GPU-like device (`ingero lab run
--device gpu`), untraced vs everything on: `--profiler` (every rank loads
Ingero's NCCL profiler plugin) and `--trace` (which then also records the
plugin's operations). `--device cpu,gpu` runs both in every round, side by
side. Also reports the tracers' own CPU while tracing, from their
logs (``tracing used ... s CPU``). ``--baseline DIR`` adds a third
alternating set traced by another version of the code (DIR: a copy of the
repository, e.g. ``git worktree add DIR <commit>``; DIR and DIR/agent go
first on PYTHONPATH), for a before/after comparison in one run. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CPU_LINE = re.compile(r"tracing used ([\d.]+) s CPU in ([\d.]+) s")


DEVICES = ("cpu", "gpu")


def one_run(out: Path, seconds: float, trace: bool, code: Path | None = None, device: str = "cpu"
            ) -> tuple[float, float | None]:
    """(mean step ms over the ranks, the tracers' CPU while tracing as % of one core, summed).

    `code`: run this copy of the repository instead of the installed one. `device` gpu:
    the GPU-like device, and traced means with the profiler plugin too."""
    cmd = [sys.executable, "-m", "ingero", "lab", "run", "--scenario", "clean",
           "--seconds", str(seconds), "--out", str(out)] + (["--trace"] if trace else [])
    if device != "cpu":
        cmd += ["--device", device] + (["--profiler"] if trace else [])
    env = None
    if code is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(code), str(code / "agent")] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                       cwd=str(code) if code is not None else None)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SystemExit(f"bench.step_overhead: `{' '.join(cmd[1:])}` exited {p.returncode}: {tail}")
    lab = json.loads((out / "lab.json").read_text())
    step = statistics.fmean(r["stats"]["mean_step_ms"] for r in lab["ranks"])
    cpu = None
    if trace:
        shares = []
        for log in sorted((out / "nodes").glob("*.tracer.log")):
            m = CPU_LINE.search(log.read_text(errors="replace"))
            if m:
                shares.append(100.0 * float(m.group(1)) / float(m.group(2)))
        cpu = sum(shares) if shares else None
    return step, cpu


def summary(off: list[float], on: list[float], cpu: list[float]) -> dict:
    """Medians of the untraced and traced sets, and of the per-round ratios."""
    r = {"untraced_ms": statistics.median(off), "traced_ms": statistics.median(on), "rounds": len(off),
         "untraced_all": off, "traced_all": on,
         "paired_overhead_pct": 100.0 * (statistics.median(b / x for x, b in zip(off, on)) - 1.0),
         "tracer_cpu_pct_of_core": statistics.median(cpu) if cpu else None}
    r["overhead_pct"] = 100.0 * (r["traced_ms"] / r["untraced_ms"] - 1.0)
    return r


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--device", default="cpu", metavar="cpu|gpu|cpu,gpu",
                    help="the lab device(s); several are alternated in every round (default cpu)")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also trace with the code in this copy of the repository (before/after)")
    a = ap.parse_args(argv)
    devices = [d.strip() for d in a.device.split(",")]
    if a.rounds < 1 or a.seconds <= 0:
        raise SystemExit("bench.step_overhead: --rounds must be >= 1 and --seconds > 0")
    if not devices or any(d not in DEVICES for d in devices) or len(set(devices)) != len(devices):
        raise SystemExit(f"bench.step_overhead: --device {a.device}: use cpu, gpu or cpu,gpu")
    base = a.baseline.resolve() if a.baseline else None
    if base is not None and not ((base / "ingero" / "__init__.py").is_file()
                                 and (base / "agent" / "ingero_agent" / "tracer.py").is_file()):
        raise SystemExit(f"bench.step_overhead: --baseline {a.baseline} is not a copy of the "
                         "repository (no ingero/ and agent/ingero_agent/ in it)")
    sets = {d: {"off": [], "on": [], "cpu": [], "b_on": [], "b_cpu": []} for d in devices}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for dev in devices:
                st, d = sets[dev], Path(tmp) / dev
                st["off"].append(one_run(d / f"off{i}", a.seconds, trace=False, device=dev)[0])
                step, c = one_run(d / f"on{i}", a.seconds, trace=True, device=dev)
                st["on"].append(step)
                if c is not None:
                    st["cpu"].append(c)
                line = (f"round {i + 1} {dev}: untraced {st['off'][-1]:.2f} ms, traced {step:.2f} ms "
                        f"({100.0 * (step / st['off'][-1] - 1.0):+.2f}%)"
                        + (f", tracers {c:.2f}% of a core" if c is not None else ""))
                if base is not None:
                    step, c = one_run(d / f"base{i}", a.seconds, trace=True, code=base, device=dev)
                    st["b_on"].append(step)
                    if c is not None:
                        st["b_cpu"].append(c)
                    line += f"; baseline traced {step:.2f} ms ({100.0 * (step / st['off'][-1] - 1.0):+.2f}%)"
                print(line, flush=True)
    out = {}
    for dev, st in sets.items():
        r = out[dev] = summary(st["off"], st["on"], st["cpu"])
        what = "traced" if dev == "cpu" else "profiler plugin + traced"
        print(f"step overhead ({dev}): untraced {r['untraced_ms']:.2f} ms, {what} {r['traced_ms']:.2f} ms "
              f"(median of {a.rounds} alternating runs) = {r['overhead_pct']:+.2f}%; median of "
              f"per-round ratios {r['paired_overhead_pct']:+.2f}% (target <= 1%)"
              + (f"; tracers used {r['tracer_cpu_pct_of_core']:.2f}% of a core"
                 if r["tracer_cpu_pct_of_core"] is not None else ""))
        if base is not None:
            b = r["baseline"] = summary(st["off"], st["b_on"], st["b_cpu"])
            b["code"] = str(base)
            print(f"baseline ({base}, {dev}): traced {b['traced_ms']:.2f} ms = {b['overhead_pct']:+.2f}%; "
                  f"median of per-round ratios {b['paired_overhead_pct']:+.2f}%"
                  + (f"; tracers used {b['tracer_cpu_pct_of_core']:.2f}% of a core"
                     if b["tracer_cpu_pct_of_core"] is not None else
                     " (its tracers do not report their CPU)"))
    return out


if __name__ == "__main__":
    main()
