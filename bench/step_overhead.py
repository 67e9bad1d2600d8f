"""Step-time overhead of tracing: the lab workload with every probe on vs none.

    python -m bench.step_overhead [--rounds 3] [--seconds 8] [--device cpu,gpu] [--nodes 2 --ranks-per-node 2]
                                  [--baseline DIR] [--bpf-stats]

Runs the clean lab scenario (2 nodes x 2 ranks; `--nodes`, `--ranks-per-node`)
alternately without and with `--trace` (all probes: nccl, tcp, sched; one
tracer per lab node), so both
see the same machine noise, and compares the job's mean step time: the
median of each set, and the median of the per-round ratios (traced over the
untraced run just before it), which drifting load on a shared machine
disturbs less. `--device gpu`: the lab's GPU-like device (`ingero lab run
--device gpu`), untraced vs everything on: `--profiler` (every rank loads
Ingero's NCCL profiler plugin) and `--trace` (which then also records the
plugin's operations). `--device cpu,gpu` runs both in every round, side by
side. Also reports the tracers' own CPU while tracing, from their
logs (``tracing used ... s CPU``), and with ``--bpf-stats`` the BPF programs'
own run time (``kernel.bpf_stats_enabled`` on for the run, then restored:
the summed ``run_time_ns`` of every program the lab's tracers hold, sampled
while the ranks run, as microseconds per second; the traced threads pay it,
so it is not in the tracers' CPU). ``--baseline DIR`` adds a third
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
import time
from pathlib import Path

CPU_LINE = re.compile(r"tracing used ([\d.]+) s CPU in ([\d.]+) s")
RUN_TIME = re.compile(r"^run_time_ns:\s+(\d+)", re.M)
STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
WORKER = b"ingero-lab-worker"


DEVICES = ("cpu", "gpu")


def bpf_sample(out: Path) -> tuple[int, bool]:
    """(summed run_time_ns of the BPF programs held by the tracers of the lab run writing to
    `out`, whether any lab rank is running)."""
    total, ranks, marker = 0, False, str(out / "nodes").encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(WORKER):
            ranks = True
        if b"trace" not in cmd or not any(marker in c for c in cmd):
            continue
        try:
            infos = list((proc / "fdinfo").iterdir())
        except OSError:
            continue
        for f in infos:
            try:
                text = f.read_text()
            except OSError:
                continue
            m = RUN_TIME.search(text)
            if m and "prog_id:" in text:
                total += int(m.group(1))
    return total, ranks


def one_run(out: Path, seconds: float, trace: bool, code: Path | None = None, device: str = "cpu",
            bpf_stats: bool = False, shape: tuple[int, int] = (2, 2)
            ) -> tuple[float, float | None, float | None]:
    """(mean step ms over the ranks, the tracers' CPU while tracing as % of one core, summed,
    the tracers' BPF programs' run time while the ranks ran in microseconds per second, when
    `bpf_stats` and traced).

    `code`: run this copy of the repository instead of the installed one. `device` gpu:
    the GPU-like device, and traced means with the profiler plugin too. `shape`: (lab nodes,
    ranks per node)."""
    cmd = [sys.executable, "-m", "ingero", "lab", "run", "--scenario", "clean",
           "--seconds", str(seconds), "--out", str(out), "--nodes", str(shape[0]),
           "--ranks-per-node", str(shape[1])] + (["--trace"] if trace else [])
    if device != "cpu":
        cmd += ["--device", device] + (["--profiler"] if trace else [])
    env = None
    if code is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(code), str(code / "agent")] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=str(code) if code is not None else None)
    samples = []     # (monotonic s, BPF ns) while the ranks run
    while bpf_stats and trace and p.poll() is None:
        t, (ns, ranks) = time.monotonic(), bpf_sample(out)
        if ranks and ns:
            samples.append((t, ns))
        time.sleep(0.5)
    _, stderr = p.communicate()
    if p.returncode != 0:
        tail = (stderr.strip().splitlines() or ["(no message)"])[-1]
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
    bpf = None
    if len(samples) >= 2 and samples[-1][0] > samples[0][0]:
        bpf = (samples[-1][1] - samples[0][1]) / 1e3 / (samples[-1][0] - samples[0][0])
    return step, cpu, bpf


def summary(off: list[float], on: list[float], cpu: list[float], bpf: list[float] | None = None) -> dict:
    """Medians of the untraced and traced sets, and of the per-round ratios."""
    r = {"untraced_ms": statistics.median(off), "traced_ms": statistics.median(on), "rounds": len(off),
         "untraced_all": off, "traced_all": on,
         "paired_overhead_pct": 100.0 * (statistics.median(b / x for x, b in zip(off, on)) - 1.0),
         "tracer_cpu_pct_of_core": statistics.median(cpu) if cpu else None,
         "bpf_us_per_s": statistics.median(bpf) if bpf else None}
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
    ap.add_argument("--nodes", type=int, default=2, help="lab nodes (one tracer each); default 2")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="default 2")
    ap.add_argument("--bpf-stats", action="store_true",
                    help="also report the tracers' BPF run time (kernel.bpf_stats_enabled for the run)")
    a = ap.parse_args(argv)
    devices = [d.strip() for d in a.device.split(",")]
    if a.rounds < 1 or a.seconds <= 0:
        raise SystemExit("bench.step_overhead: --rounds must be >= 1 and --seconds > 0")
    if a.nodes < 1 or a.ranks_per_node < 1 or a.nodes * a.ranks_per_node < 2:
        raise SystemExit("bench.step_overhead: --nodes and --ranks-per-node must be >= 1, with 2 ranks "
                         "or more in all")
    if not devices or any(d not in DEVICES for d in devices) or len(set(devices)) != len(devices):
        raise SystemExit(f"bench.step_overhead: --device {a.device}: use cpu, gpu or cpu,gpu")
    base = a.baseline.resolve() if a.baseline else None
    if base is not None and not ((base / "ingero" / "__init__.py").is_file()
                                 and (base / "agent" / "ingero_agent" / "tracer.py").is_file()):
        raise SystemExit(f"bench.step_overhead: --baseline {a.baseline} is not a copy of the "
                         "repository (no ingero/ and agent/ingero_agent/ in it)")
    old_stats = STATS.read_text().strip() if a.bpf_stats else None
    if a.bpf_stats:
        try:
            STATS.write_text("1")
        except OSError as e:
            raise SystemExit(f"bench.step_overhead: --bpf-stats: cannot turn on {STATS} ({e.strerror}); "
                             "run as root") from None
    try:
        return _rounds(a, devices, base)
    finally:
        if old_stats is not None:
            STATS.write_text(old_stats)


def _rounds(a, devices: list[str], base: Path | None) -> dict:
    sets = {d: {"off": [], "on": [], "cpu": [], "bpf": [], "b_on": [], "b_cpu": [], "b_bpf": []}
            for d in devices}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for dev in devices:
                st, d = sets[dev], Path(tmp) / dev
                shape = (a.nodes, a.ranks_per_node)
                st["off"].append(one_run(d / f"off{i}", a.seconds, trace=False, device=dev, shape=shape)[0])
                step, c, bpf = one_run(d / f"on{i}", a.seconds, trace=True, device=dev, bpf_stats=a.bpf_stats,
                                       shape=shape)
                st["on"].append(step)
                if c is not None:
                    st["cpu"].append(c)
                if bpf is not None:
                    st["bpf"].append(bpf)
                line = (f"round {i + 1} {dev}: untraced {st['off'][-1]:.2f} ms, traced {step:.2f} ms "
                        f"({100.0 * (step / st['off'][-1] - 1.0):+.2f}%)"
                        + (f", tracers {c:.2f}% of a core" if c is not None else "")
                        + (f", BPF {bpf:.0f} us/s" if bpf is not None else ""))
                if base is not None:
                    step, c, bpf = one_run(d / f"base{i}", a.seconds, trace=True, code=base, device=dev,
                                           bpf_stats=a.bpf_stats, shape=shape)
                    st["b_on"].append(step)
                    if c is not None:
                        st["b_cpu"].append(c)
                    if bpf is not None:
                        st["b_bpf"].append(bpf)
                    line += (f"; baseline traced {step:.2f} ms ({100.0 * (step / st['off'][-1] - 1.0):+.2f}%)"
                             + (f", BPF {bpf:.0f} us/s" if bpf is not None else ""))
                print(line, flush=True)
    out = {}
    for dev, st in sets.items():
        r = out[dev] = summary(st["off"], st["on"], st["cpu"], st["bpf"])
        what = "traced" if dev == "cpu" else "profiler plugin + traced"
        print(f"step overhead ({dev}): untraced {r['untraced_ms']:.2f} ms, {what} {r['traced_ms']:.2f} ms "
              f"(median of {a.rounds} alternating runs) = {r['overhead_pct']:+.2f}%; median of "
              f"per-round ratios {r['paired_overhead_pct']:+.2f}% (target <= 1%)"
              + (f"; tracers used {r['tracer_cpu_pct_of_core']:.2f}% of a core"
                 if r["tracer_cpu_pct_of_core"] is not None else "")
              + (f"; their BPF programs ran {r['bpf_us_per_s']:.0f} us per second"
                 if r["bpf_us_per_s"] is not None else ""))
        if base is not None:
            b = r["baseline"] = summary(st["off"], st["b_on"], st["b_cpu"], st["b_bpf"])
            b["code"] = str(base)
            print(f"baseline ({base}, {dev}): traced {b['traced_ms']:.2f} ms = {b['overhead_pct']:+.2f}%; "
                  f"median of per-round ratios {b['paired_overhead_pct']:+.2f}%"
                  + (f"; tracers used {b['tracer_cpu_pct_of_core']:.2f}% of a core"
                     if b["tracer_cpu_pct_of_core"] is not None else
                     " (its tracers do not report their CPU)")
                  + (f"; BPF {b['bpf_us_per_s']:.0f} us per second" if b["bpf_us_per_s"] is not None else ""))
    return out


if __name__ == "__main__":
    main()
