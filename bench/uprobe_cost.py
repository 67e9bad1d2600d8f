"""Cost per probed NCCL call: Ingero's entry+return probes vs bare kernel uprobes.

    python -m bench.uprobe_cost [--calls 2000000] [--rounds 5]

A C loop calls a no-op `ncclAllReduce` (with the real signature) `--calls`
times and reports ns per call. Three set-ups run alternately, round after
round, so they share the machine's noise:

* none:   no probe;
* bare:   an empty BPF program on the uprobe and the uretprobe (the kernel's
          own cost of entry+return probing, nothing of ours);
* ingero: Ingero's NCCL probes (argument capture, communicator lookup, seq,
          ring-buffer record), the process targeted, its ring drained meanwhile
          by a Python thread of this benchmark's process every 20 ms (on a
          2-core machine it competes with the loop for CPU).

--bpf-stats also reports the programs' own run time per call, measured by the
kernel (kernel.bpf_stats_enabled=1 for the run, then restored; run_time_ns /
run_cnt from /proc/self/fdinfo of each program): robust to machine load, where
the wall-clock figures are not.

--baseline DIR adds a fourth set-up, "baseline": Ingero's probes built from
DIR/bpf (e.g. a checkout of main) by this tree's loader, in the same rounds, so
two versions of the BPF programs are compared side by side under the same load
(the two swap places every other round: neither always runs right after bare).
--target cgroup|ancestor moves the loop into a pod-like cgroup of its own and
finds it by that cgroup (as the agent's pod targets: every cgroup of the pod is
in the filter map) or by the cgroup two levels up (the filter walks the
ancestors, as for a container created since the agent's last scan), instead
of by its pid.
--agent-drain adds the set-up "agentdrain": the ring drained as the agent
drains it (asleep in epoll until the ring wakes it, a quarter full, or 2 s)
instead of every 20 ms.
--no-drain adds the set-up "nodrain": Ingero's probes as in "ingero" but no
thread drains the ring during the loop (it is read once after; its ring is
made large enough to hold every record), to measure what the drain thread
costs the loop on a machine of few cores.

Reported: the median per set-up, the probe cost (set-up minus none), and
ingero's cost over bare's. Target: ingero <= bare + 10%. Needs root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.common import compile_c, need_root, run_loop, run_loop_traced

BARE = r"""
int on_entry(void *ctx) { return 0; }
int on_return(void *ctx) { return 0; }
"""


STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
PROG_NS: dict[str, list[float]] = {}


def _prog_ns(name: str, fd: int) -> None:
    """Record the program's mean in-kernel run time per call (needs bpf_stats on)."""
    import re
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    ns = re.search(r"run_time_ns:\s+(\d+)", text)
    cnt = re.search(r"run_cnt:\s+(\d+)", text)
    if ns and cnt and int(cnt.group(1)):
        PROG_NS.setdefault(name, []).append(int(ns.group(1)) / int(cnt.group(1)))


def _bare(loop, lib, calls) -> float:
    from bcc import BPF

    b = BPF(text=BARE)
    b.attach_uprobe(name=str(lib), sym="ncclAllReduce", fn_name="on_entry")
    b.attach_uretprobe(name=str(lib), sym="ncclAllReduce", fn_name="on_return")
    try:
        ns = run_loop(loop, lib, calls)
        _prog_ns("bare entry", b.funcs[b"on_entry"].fd)
        _prog_ns("bare return", b.funcs[b"on_return"].fd)
        return ns
    finally:
        b.cleanup()


def _ingero(loop, lib, calls, name="ingero", bpf_dir=None, drain_s=0.02, target="pid"
            ) -> tuple[float, int, int]:
    """Ingero's NCCL probes (from bpf_dir, default this tree's bpf/) on the loop;
    drain_s None: no drain during the loop, in a ring that holds all its records."""
    from ingero_agent.elfsyms import nccl_symbols
    from ingero_agent.probes import ProbeConfig, Probes

    old = os.environ.get("INGERO_BPF_DIR")
    if bpf_dir is not None:
        os.environ["INGERO_BPF_DIR"] = str(bpf_dir)
    try:
        cfg = ProbeConfig(families=("nccl",), self_tgid=os.getpid())
        if drain_s is None:   # 104-byte records + 8-byte headers, in a power-of-2 page count
            pages = cfg.ringbuf_pages
            while pages * 4096 < (calls + 2) * 112:
                pages *= 2
            cfg = ProbeConfig(families=("nccl",), self_tgid=os.getpid(), ringbuf_pages=pages)
        p = Probes(cfg)
    finally:
        if bpf_dir is not None:
            if old is None:
                os.environ.pop("INGERO_BPF_DIR", None)
            else:
                os.environ["INGERO_BPF_DIR"] = old
    st = lib.stat()
    p.attach_library(lib, (st.st_dev, st.st_ino), nccl_symbols(lib))
    try:
        ns, got = run_loop_traced(loop, lib, calls, p, "nccl", drain_s, target)
        _prog_ns(f"{name} entry", p.bpf.funcs[b"nccl_enter_ncclAllReduce"].fd)
        _prog_ns(f"{name} return", p.bpf.funcs[b"nccl_return"].fd)
        return ns, got, p.lost()["nccl"]
    finally:
        p.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bpf-stats", action="store_true",
                    help="also report the programs' in-kernel run time per call")
    ap.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                    help="also run Ingero's probes built from DIR/bpf (e.g. a checkout of main)")
    ap.add_argument("--target", choices=("pid", "cgroup", "ancestor"), default="pid",
                    help="how the filter finds the loop: its pid (default), its own cgroup, or an "
                         "ancestor cgroup two levels up (the filter walks up to it)")
    ap.add_argument("--agent-drain", action="store_true",
                    help="also run Ingero's probes drained as the agent drains (ring wake-ups)")
    ap.add_argument("--no-drain", action="store_true",
                    help="also run Ingero's probes with no drain thread during the loop")
    a = ap.parse_args(argv)
    need_root("uprobe_cost")
    old_stats = STATS.read_text().strip() if a.bpf_stats else None
    if a.bpf_stats:
        STATS.write_text("1")
    try:
        return _main(a)
    finally:
        if old_stats is not None:
            STATS.write_text(old_stats)


def _main(a) -> dict:
    res = {"none": [], "bare": [], "ingero": []}
    base_dir = None
    if a.baseline is not None:
        base_dir = (a.baseline / "bpf").resolve()
        if not (base_dir / "ingero.h").is_file():
            raise SystemExit(f"--baseline {a.baseline}: no bpf/ingero.h there")
        res["baseline"] = []
    if a.agent_drain:
        res["agentdrain"] = []
    if a.no_drain:
        res["nodrain"] = []
    events = lost = 0
    with tempfile.TemporaryDirectory() as d:
        lib = compile_c(Path(d) / "libnccl.so.2", ["nccl_noop.c"], shared=True)
        loop = compile_c(Path(d) / "callloop", ["callloop.c"], libs=("-ldl",))
        pair = [("ingero", None)] + ([("baseline", base_dir)] if base_dir is not None else [])
        for i in range(a.rounds):
            res["none"].append(run_loop(loop, lib, a.calls))
            res["bare"].append(_bare(loop, lib, a.calls))
            for name, src in pair if i % 2 == 0 else pair[::-1]:
                ns, ev, lo = _ingero(loop, lib, a.calls, name, src, target=a.target)
                res[name].append(ns)
                if name == "ingero":
                    events += ev
                    lost += lo
            if a.agent_drain:
                ns, ev, lo = _ingero(loop, lib, a.calls, "agentdrain", None, "agent", a.target)
                res["agentdrain"].append(ns)
                events += ev
                lost += lo
            if a.no_drain:
                ns, ev, lo = _ingero(loop, lib, a.calls, "nodrain", None, None, a.target)
                res["nodrain"].append(ns)
                if ev != a.calls + 1 or lo:
                    raise SystemExit(f"nodrain: read {ev:,} records of {a.calls + 1:,}, lost {lo:,}")
    med = {k: statistics.median(v) for k, v in res.items()}
    low = {k: min(v) for k, v in res.items()}
    bare_cost, ours = med["bare"] - med["none"], med["ingero"] - med["none"]
    r = {"median_ns": med, "min_ns": low,
         "ratio_min": (low["ingero"] - low["none"]) / (low["bare"] - low["none"]), "bare_cost_ns": bare_cost, "ingero_cost_ns": ours,
         "ratio": ours / bare_cost, "events": events, "lost": lost,
         "expected_events": a.rounds * (a.calls + 1) * (2 if a.agent_drain else 1), "all": res}
    print(f"uprobe cost per call (median of {a.rounds} alternating rounds x {a.calls:,} calls): "
          f"unprobed {med['none']:.1f} ns, bare entry+return {med['bare']:.1f} ns "
          f"(+{bare_cost:.0f}), ingero {med['ingero']:.1f} ns (+{ours:.0f}) = "
          f"{100 * (ours / bare_cost - 1):+.1f}% over bare (target <= +10%; by the fastest "
          f"round {100 * (r['ratio_min'] - 1):+.1f}%); "
          f"events {events:,} of {r['expected_events']:,}, lost {lost:,}")
    if base_dir is not None:
        base_cost = med["baseline"] - med["none"]
        r["baseline_cost_ns"] = base_cost
        r["ratio_baseline"] = base_cost / bare_cost
        print(f"baseline ({base_dir}) {med['baseline']:.1f} ns (+{base_cost:.0f}) = "
              f"{100 * (base_cost / bare_cost - 1):+.1f}% over bare; ingero/baseline probe cost "
              f"{ours / base_cost:.3f}")
    def other(key: str, label: str) -> float:
        """Another set-up's probe cost (ns per call) against bare, recorded and printed."""
        cost = med[key] - med["none"]
        r[f"{key}_cost_ns"] = cost
        r[f"ratio_{key}"] = cost / bare_cost
        print(f"{label}: {med[key]:.1f} ns (+{cost:.0f}) = {100 * (cost / bare_cost - 1):+.1f}% over bare", end="")
        return cost

    if a.agent_drain:
        other("agentdrain", "drained as the agent drains")
        r["ratio_min_agentdrain"] = (low["agentdrain"] - low["none"]) / (low["bare"] - low["none"])
        print(f" (by the fastest round {100 * (r['ratio_min_agentdrain'] - 1):+.1f}%)")
    if a.no_drain:
        nd_cost = other("nodrain", "not drained during the loop")
        print(f"; drained/undrained probe cost {ours / nd_cost:.3f}")
    if PROG_NS:
        r["bpf_ns_per_call"] = {k: statistics.median(v) for k, v in PROG_NS.items()}
        print("in-kernel BPF run time per call (median of rounds): " + ", ".join(
            f"{k} {v:.0f} ns" for k, v in r["bpf_ns_per_call"].items()))
        b = r["bpf_ns_per_call"]
        if "baseline entry" in b and "ingero entry" in b:
            ours_k = b["ingero entry"] + b["ingero return"]
            base_k = b["baseline entry"] + b["baseline return"]
            print(f"in-kernel entry+return: ingero {ours_k:.0f} ns, baseline {base_k:.0f} ns "
                  f"(ratio {ours_k / base_k:.3f})")
    return r


if __name__ == "__main__":
    main()
