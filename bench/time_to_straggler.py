"""Time from fault injection to a named straggler in a running TraceSession's status.

    python -m bench.time_to_straggler [--faults lossy-link,slow-rank] [--runs 3] [--fault-after 8]
                                      [--timeout 45] [--quick]

Each run is the whole flow of ``ingero demo`` (operator/ingero_operator/demo.py):
an embedded API server, the operator with its default settings, one agent per
lab node with real eBPF probes, and a lab job of 2 nodes x 2 ranks registered
as Pods. The TraceSession is applied and the job started clean; the lab
injects the fault ``--fault-after`` seconds after the ranks start (lossy-link:
the nftables loss rule on the victim node's switch port; slow-rank: the
victim's compute time doubles from that wall-clock instant on; the instant is
``fault_injected_ns`` in the lab's lab.json). The benchmark polls the
resource's status every 50 ms until ``status.straggler`` names the victim
(lossy-link: its node, cause network; slow-rank: its rank, cause
compute/unknown) and reports the seconds from injection to that status.

A straggler named before the fault (a false positive of the clean phase) is
reported too. Needs root (eBPF, network namespaces) and kubectl.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 10.0
EXPECT = {"lossy-link": "network", "slow-rank": "compute/unknown", "io-stall": "io",
          "cpu-hog": "cpu-contention"}


def one_run(fault: str, fault_after: float, timeout: float, out: Path, poll_s: float = 0.05) -> dict:
    sys.path.insert(0, str(REPO / "operator"))
    from ingero_operator.demo import Demo, DemoConfig
    from ingero_operator.settings import Settings

    # A fresh folder per run (the operator keys a session's files by UID, so an earlier
    # run's data would not be read; this just keeps the disk use of many runs bounded).
    shutil.rmtree(out, ignore_errors=True)
    cfg = DemoConfig(scenario=fault, seconds=fault_after + timeout + 5, out=out, fault_after_s=fault_after)
    quiet = []
    with Demo(cfg, log=quiet.append) as demo:
        demo.apply_session()
        nodes = len(demo.lab.nodes)
        demo.wait_for(lambda s: s.get("phase") == "Running" and sum(
            n.get("state") == "running" for n in s.get("nodes", [])) == nodes, 90,
            "the agents to attach their probes")
        demo.lab.start_ranks()
        started = time.time_ns()
        victim, vnode = demo.lab.victim, demo.lab.victim_node.name
        res = {"fault": fault, "victim_rank": victim, "victim_node": vnode, "before_fault": None,
               "seconds": None, "refreshes": 0}
        last_rv = None
        while True:
            doc = demo.cluster.get(f"/apis/ingero.io/v1alpha1/namespaces/default/tracesessions/{demo.session_name}")
            now = time.time_ns()
            st = (doc or {}).get("status") or {}
            rv = (doc or {}).get("metadata", {}).get("resourceVersion")
            if rv != last_rv:
                last_rv = rv
                res["refreshes"] += 1
            inj = demo.lab.times.get("fault_injected_ns")
            s = st.get("straggler")
            if s and (inj is None or now < inj) and res["before_fault"] is None:
                res["before_fault"] = {"after_start_s": (now - started) / 1e9, **s}
            if s and inj and now >= inj:
                hit = (s.get("node") == vnode) if fault == "lossy-link" else (s.get("rank") == victim)
                if hit and s.get("cause") == EXPECT.get(fault):
                    res.update(seconds=(now - inj) / 1e9, straggler=s,
                               fault_after_start_s=(inj - started) / 1e9)
                    break
            if (now - started) / 1e9 > fault_after + timeout or st.get("phase") in ("Completed", "Failed"):
                res["last_status"] = {k: st.get(k) for k in ("phase", "straggler", "retransmits", "message")}
                break
            if any(rp.proc.poll() is not None for rp in demo.lab.ranks):
                res["last_status"] = {"error": "a rank exited early", **{k: st.get(k) for k in ("phase",)}}
                break
            time.sleep(poll_s)
        res["refresh_interval_s"] = Settings().timing.refresh_interval_s
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", default="lossy-link,slow-rank")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fault-after", type=float, default=8.0, help="seconds of clean training first")
    ap.add_argument("--timeout", type=float, default=45.0, help="give up this long after the fault")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench-time-to-straggler")
    ap.add_argument("--quick", action="store_true", help="lossy-link only, one run")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("time_to_straggler: skipped: needs root (eBPF, network namespaces)")
        return {"skipped": "needs root"}
    if a.quick:
        a.faults, a.runs = "lossy-link", 1
    results: dict = {"fault_after_s": a.fault_after, "target_s": TARGET_S, "cpus": os.cpu_count(), "faults": {}}
    print(f"time_to_straggler: 2 nodes x 2 ranks, fault {a.fault_after:g} s after the ranks start, "
          f"{a.runs} runs per fault; {os.cpu_count()} CPUs")
    for fault in [f for f in a.faults.split(",") if f]:
        runs = []
        for i in range(a.runs):
            r = one_run(fault, a.fault_after, a.timeout, a.out / f"{fault}-{i}")
            runs.append(r)
            print(f"  {fault} run {i + 1}: " + (f"named {r['seconds']:.1f} s after the fault"
                                                 if r["seconds"] is not None else
                                                 f"not named within {a.timeout:g} s: {r.get('last_status')}")
                  + (f"; straggler named BEFORE the fault: {r['before_fault']}" if r["before_fault"] else ""),
                  flush=True)
        secs = [r["seconds"] for r in runs if r["seconds"] is not None]
        summary = {"runs": runs, "named": len(secs), "false_positives": sum(1 for r in runs if r["before_fault"])}
        if secs:
            summary.update(median_s=statistics.median(secs), min_s=min(secs), max_s=max(secs))
            print(f"  {fault}: median {summary['median_s']:.1f} s (min {summary['min_s']:.1f}, "
                  f"max {summary['max_s']:.1f}) over {len(secs)}/{len(runs)} runs; target <= {TARGET_S:.0f} s")
        results["faults"][fault] = summary
    return results


if __name__ == "__main__":
    main()
