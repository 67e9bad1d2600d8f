"""Step-time cost of Ingero's NCCL profiler plugin with its proxy summaries, and its memory
over a long run, on the lab's GPU-like device.

    python -m bench.proxy_overhead [--rounds 5] [--seconds 8] [--long-seconds 120]

Each round runs the clean GPU-like job (``ingero lab run --device gpu``, 2 nodes x 2
ranks, untraced: the plugin's own cost in the ranks) three times, one after the other so
they share the machine's noise: without the plugin ("off"), with it but no proxy events
(``INGERO_PROFILER_PROXY_RING=0``: Coll, P2p and kernel-channel events only, "proxy off"),
and with its defaults ("proxy on": ProxyOp, ProxyStep and NetPlugin events summarised per
ProxyOp); every other round in the reverse order, so that a machine getting busier or
quieter during a round weighs on both sides alike. On a shared machine a run's mean step
moves by tens of percent with the load, far more than the cost sought: each round gives
paired differences (proxy on against proxy off, and against off, in % of the latter),
and reported is their median with a distribution-free confidence interval (order
statistics, the sign test's binomial: 95%, from 6 rounds on). The cost is shown under 1%
when the interval's upper end is; an interval wider than that says how many rounds it
would take (its width shrinks as 1/sqrt(rounds)). Then one long run with proxy on samples
every rank's resident memory (VmRSS) and the plugin's shared mappings
(``/memfd:ingero-nccl-ops``: slots and proxy ring, fixed in size, touched as they are
used) once a second: bounded when the resident memory outside the mappings peaks in the
run's last quarter within 2% of its second quarter's (the first is warm-up) and the
mappings' resident part stays within their size. Needs root (network namespaces,
cgroups).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

MAPPING = "ingero-nccl-ops"
TARGET_PCT = 1.0          # the proxy events may cost at most this much of the step


def median_ci(x: list, level: float = 0.95) -> tuple:
    """(low, median, high) of `x`: the median and a distribution-free confidence interval for
    it, the k-th smallest and largest values for the largest k with P(Binomial(n, 1/2) < k) <=
    (1 - level) / 2; low and high None when n is too small for `level`."""
    from ingero.analysis.proxy import sign_test

    v = sorted(x)
    n = len(v)
    if not n:
        return None, None, None
    k = 0
    while k + 1 <= n // 2 and sign_test(n - k, n) <= (1 - level) / 2:   # P(X <= k) = P(X >= n - k)
        k += 1
    mid = statistics.median(v)
    return (v[k - 1], mid, v[n - k]) if k else (None, mid, None)


def rank_memory(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS, Rss and Size of the plugin's mappings) of process `pid`, KiB; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        smaps = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    rss = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), 0)
    plugin = size = 0
    inside = False
    for ln in smaps.splitlines():
        head = ln.split()
        if head and "-" in head[0] and len(head) >= 5:      # a mapping's first line
            inside = MAPPING in ln
        elif inside and ln.startswith("Rss:"):
            plugin += int(head[1])
        elif inside and ln.startswith("Size:"):
            size += int(head[1])
    return rss, plugin, size


def one_run(out: Path, seconds: float, plugin: Path | None, proxy: bool, sample: bool = False) -> dict:
    """One clean GPU-like lab run: {"step_ms": mean step over the ranks, "memory": [(s, rss KiB
    summed over the ranks, plugin mapping KiB summed)] when `sample`}."""
    from ingero.lab.runner import LabConfig, LabRun

    old = os.environ.get("INGERO_PROFILER_PROXY_RING")
    if proxy:
        os.environ.pop("INGERO_PROFILER_PROXY_RING", None)
    else:
        os.environ["INGERO_PROFILER_PROXY_RING"] = "0"      # the ranks inherit it (LabRun.rank_env)
    samples: list = []
    try:
        cfg = LabConfig(scenario="clean", device="gpu", seconds=seconds, out_dir=out, profiler_plugin=plugin)
        with LabRun(cfg, log=lambda _m: None) as lab:
            lab.start_ranks()
            stop = threading.Event()

            def poll():
                t0 = time.monotonic()
                while not stop.wait(1.0):
                    got = [rank_memory(rp.proc.pid) for rp in lab.ranks if rp.proc is not None]
                    got = [g for g in got if g is not None]
                    if got:
                        samples.append((time.monotonic() - t0, *(sum(g[k] for g in got) for k in range(3))))
            th = threading.Thread(target=poll, daemon=True)
            if sample:
                th.start()
            codes = lab.wait()
            stop.set()
            if sample:
                th.join()
            report = lab.report()
    finally:
        if old is None:
            os.environ.pop("INGERO_PROFILER_PROXY_RING", None)
        else:
            os.environ["INGERO_PROFILER_PROXY_RING"] = old
    if set(codes.values()) != {0}:
        raise SystemExit(f"bench.proxy_overhead: rank exit codes {codes}")
    return {"step_ms": statistics.fmean(r["stats"]["mean_step_ms"] for r in report["ranks"]), "memory": samples}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8.0, help="each timed run; default 8")
    ap.add_argument("--long-seconds", type=float, default=120.0, help="the memory run; default 120 (0: none)")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.seconds <= 0 or a.long_seconds < 0:
        raise SystemExit("bench.proxy_overhead: --rounds >= 1, --seconds > 0, --long-seconds >= 0")
    from ingero_agent.profiler_build import build_profiler

    plugin = build_profiler()
    sets: dict = {"off": [], "proxy off": [], "proxy on": []}
    runs = (("off", None, False), ("proxy off", plugin, False), ("proxy on", plugin, True))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for name, lib, proxy in runs if i % 2 == 0 else runs[::-1]:
                sets[name].append(one_run(Path(tmp) / f"{name.replace(' ', '-')}{i}", a.seconds, lib, proxy)["step_ms"])
            off, no, on = (sets[k][-1] for k in ("off", "proxy off", "proxy on"))
            print(f"round {i + 1}: off {off:.2f} ms, proxy off {no:.2f} ms ({100 * (no / off - 1):+.2f}%), "
                  f"proxy on {on:.2f} ms ({100 * (on / off - 1):+.2f}%)", flush=True)
        long = one_run(Path(tmp) / "long", a.long_seconds, plugin, True, sample=True) if a.long_seconds else None
    med = {k: statistics.median(v) for k, v in sets.items()}
    r = {"median_step_ms": med, "all": sets}
    print(f"plugin cost on the GPU-like lab (clean, 2x2, {a.rounds} rounds of 3 runs of {a.seconds:g} s, "
          f"alternating order): median mean step off {med['off']:.2f} ms, plugin with proxy off "
          f"{med['proxy off']:.2f} ms, with proxy on {med['proxy on']:.2f} ms")
    for key, x, y in (("on_vs_proxy_off", "proxy on", "proxy off"), ("on_vs_off", "proxy on", "off"),
                      ("proxy_off_vs_off", "proxy off", "off")):
        d = [100.0 * (b_ / a_ - 1.0) for a_, b_ in zip(sets[y], sets[x])]
        lo, mid, hi = median_ci(d)
        r[key] = {"pct": d, "median": mid, "ci95": (lo, hi)}
        if lo is None:
            say = f"no 95% interval from {len(d)} rounds (6 needed)"
        else:
            need = len(d) * ((hi - lo) / 2.0 / TARGET_PCT) ** 2 if hi > TARGET_PCT and hi > lo else 0
            say = (f"95% CI {lo:+.2f} .. {hi:+.2f}%: " + (f"under {TARGET_PCT:g}%, shown" if hi <= TARGET_PCT else
                   f"not shown under {TARGET_PCT:g}% (an interval of +-{TARGET_PCT:g}% would take about {need:.0f} rounds)"))
        print(f"  {x} vs {y}: paired difference median {mid:+.2f}%, {say}")
    if long and len(long["memory"]) >= 8:
        mem = long["memory"]
        q = len(mem) // 4
        first, last = mem[q:2 * q], mem[-q:]               # the first quarter is warm-up
        other = lambda rows: max(m[1] - m[2] for m in rows)  # VmRSS outside the plugin's mapping
        r["memory"] = {"seconds": a.long_seconds, "samples": len(mem), "other_rss_kib": (other(first), other(last)),
                       "mapping_rss_kib": (max(m[2] for m in first), max(m[2] for m in last)),
                       "mapping_size_kib": max(m[3] for m in mem), "step_ms": long["step_ms"]}
        m = r["memory"]
        bounded = m["other_rss_kib"][1] <= 1.02 * m["other_rss_kib"][0] and m["mapping_rss_kib"][1] <= m["mapping_size_kib"]
        print(f"memory over {a.long_seconds:.0f} s with proxy on (4 ranks, summed; second quarter vs last): VmRSS "
              f"outside the plugin's mapping {m['other_rss_kib'][0]:,} -> {m['other_rss_kib'][1]:,} KiB; the mapping "
              f"{m['mapping_rss_kib'][0]:,} -> {m['mapping_rss_kib'][1]:,} KiB resident of {m['mapping_size_kib']:,} KiB "
              f"(touched as used, never more): {'bounded' if bounded else 'GROWING'}")
    return r


if __name__ == "__main__":
    main()
