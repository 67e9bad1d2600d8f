"""Cost per NCCL operation of Ingero's NCCL profiler plugin, traced and not.

    python -m bench.profiler_cost [--ops 300000] [--rounds 9]

A C loop (bench/csrc/profiler_loop.c) makes the calls NCCL 2.28+ makes into a
profiler plugin (API v5) for one collective on two channels, `--ops` times,
and reports ns per operation. Three set-ups run alternately, round after
round, so they share the machine's noise:

* none:    no plugin: NCCL skips every call (the loop's own cost: its clock
           reads for the fake GPU timestamps);
* plugin:  Ingero's plugin, no tracer: the USDT probe is a nop;
* traced:  the plugin with the agent's probe attached to it (bcc USDT, the
           cgroup filter, one 288-byte ring record per operation), the process
           targeted by pid, its ring (RING_PAGES) drained by a thread of this
           benchmark every DRAIN_S (on a 2-core machine it competes with the loop).

Reported: the median per set-up, the plugin's cost (plugin - none) and the
probe's (traced - plugin), the records received and lost. Needs root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.common import compile_c, need_root, run_loop, run_loop_traced

ROOT = Path(__file__).resolve().parents[1]
# The loop finishes an operation every ~1.3 us traced, 770,000 records (210 MB) a
# second: far beyond a training job's rate, so the ring is larger than the agent's
# default (8192 pages, 32 MiB: ~0.15 s of this loop) and drained every 10 ms.
RING_PAGES = 8192
DRAIN_S = 0.01


def _traced(loop: Path, lib: Path, ops: int) -> tuple[float, int, int]:
    from ingero_agent.probes import ProbeConfig, Probes

    p = Probes(ProbeConfig(families=("nccl",), ringbuf_pages=RING_PAGES, self_tgid=os.getpid()))
    st = lib.stat()
    p.attach_profiler(lib, (st.st_dev, st.st_ino))
    try:
        ns, got = run_loop_traced(loop, lib, ops, p, "nccl_profiler", DRAIN_S)
        return ns, got, p.lost()["nccl_profiler"]
    finally:
        p.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    need_root("profiler_cost")
    from ingero_agent.profiler_build import build_profiler

    res = {"none": [], "plugin": [], "traced": []}
    events = lost = 0
    with tempfile.TemporaryDirectory() as d:
        lib = build_profiler(Path(d) / "lib", cache_dir=Path(d) / "cache")
        loop = compile_c(Path(d) / "profiler_loop", ["profiler_loop.c"], libs=("-ldl",),
                         includes=(ROOT / "ingero" / "csrc",))
        for _ in range(a.rounds):
            res["none"].append(run_loop(loop, Path("none"), a.ops))
            res["plugin"].append(run_loop(loop, lib, a.ops))
            ns, ev, lo = _traced(loop, lib, a.ops)
            res["traced"].append(ns)
            events += ev
            lost += lo
    med = {k: statistics.median(v) for k, v in res.items()}
    r = {"median_ns": med, "plugin_cost_ns": med["plugin"] - med["none"],
         "probe_cost_ns": med["traced"] - med["plugin"], "events": events, "lost": lost,
         "expected_events": a.rounds * a.ops, "all": res}
    print(f"profiler plugin cost per NCCL operation (median of {a.rounds} alternating rounds x {a.ops:,} ops, "
          f"one collective on 2 channels = 11 plugin calls): no plugin {med['none']:.0f} ns, plugin "
          f"{med['plugin']:.0f} ns (+{r['plugin_cost_ns']:.0f}), plugin traced {med['traced']:.0f} ns "
          f"(+{r['probe_cost_ns']:.0f} for the probe); records {events:,} of {r['expected_events']:,}, "
          f"lost {lost:,}")
    return r


if __name__ == "__main__":
    main()
