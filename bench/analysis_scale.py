"""Gather + merge + analysis at scale: 1,024 ranks along the operator's path.

    python -m bench.analysis_scale [--layout tp=8,pp=8,dp=16] [--collectives 100000] [--nodes 128]
                                   [--faults slow-rank,lossy-link] [--repeat 3] [--quick]
                                   [--baseline DIR | --every-step]

With ``--layout`` (tp=8,pp=8,dp=16 has a target: < 3 s, < 1 GiB): a tensor x pipeline x data parallel job
(``bench.synthetic.pipeline_session``, GPipe, Megatron rank order) with as many
steps as make ``--collectives`` collective instances (tp all-reduces of 8
ranks, dp all-reduces of 16, a world all-reduce per step) plus the pipeline's
send/recv pairs; one stage-0 rank in the middle of the world is 1.5x slower
(fault slow-rank only). Without it, the data-parallel session below.

A synthetic session (``bench.synthetic.scale_session``: every rank calls every
collective, ~102 M nccl_events rows, retransmits on one node, sched totals,
each node's clock off by a few ms) is written once per node through the real
SegmentWriter into the operator's layout (``<root>/work/nodes/<node>/``) and
kept under ``--data`` for later runs; writing it is not measured.

Measured, each run in a fresh process: ``gather.build_artifact`` exactly as the
operator calls it when a session completes (per-node segments, clock offsets
applied, split ranks resolved, trace.duckdb written, ``analyse``): wall time and
the process's peak RSS (a 20 ms sampling thread, and ru_maxrss; DuckDB runs in
the same process, so this includes its memory). The verdict must name the
planted straggler.

Side by side, at a size where it finishes in reasonable time
(``--compare-collectives``), the straightforward path this replaced: every row
copied into a DuckDB file, then the SQL analysis. Both reports must be equal.

With ``--baseline DIR`` (another checkout, e.g. ``git worktree add /tmp/base main``), each
measured run is followed by the same run of DIR's code on the same segments; the two
reports are compared: equal, or (where one judged a sample of the session's windows and
the other every step) their counts per rank and op, straggler and cause, and savings.
``--every-step`` does the same with this checkout judging every step (no sampled windows).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S, TARGET_GIB = 10.0, 2.0
LAYOUT_TARGET_S, LAYOUT_TARGET_GIB = 3.0, 1.0     # the tp=8, pp=8, dp=16 job with 100,000 instances
# Bump when the writer's Parquet format (ingero/store.py) or bench/synthetic.py's sessions change,
# so that kept sessions are rewritten. 2: duration_ns byte-stream-split instead of
# dictionary-encoded; 3: delta-packed instead (BYTE_STREAM_SPLIT integers need DuckDB >= 2.0
# to read); 4: a rank's calls in program order, each after its previous one returned.
FORMAT = 4


def parse_layout(text: str) -> tuple[int, int, int]:
    parts = dict(kv.split("=", 1) for kv in text.split(","))
    return int(parts["tp"]), int(parts["pp"]), int(parts["dp"])


def _data_dir(base: Path, ranks: int, collectives: int, nodes: int, segs: int, fault: str, layout: str) -> Path:
    if layout:
        return base / f"{layout.replace(',', '-').replace('=', '')}-c{collectives}-n{nodes}-{fault}-f{FORMAT}"
    return base / f"r{ranks}-c{collectives}-n{nodes}-s{segs}-{fault}-f{FORMAT}"


def ensure_session(base: Path, ranks: int, collectives: int, nodes: int, segs: int, fault: str,
                   layout: str = "") -> Path:
    """Write the session unless a complete copy is already there."""
    import shutil

    from bench.synthetic import pipeline_instances_per_step, pipeline_layout, pipeline_session, scale_session

    root = _data_dir(base, ranks, collectives, nodes, segs, fault, layout)
    done = root / "written.json"
    if done.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    truth: dict = {}
    if layout:
        tp, pp, dp = parse_layout(layout)
        steps = max(3, -(-collectives // pipeline_instances_per_step(tp, pp, dp)))
        victim = pipeline_layout(tp, pp, dp)["rank"](dp // 2, 0, tp // 2 - 1)   # stage 0, mid-world
        print(f"  writing {layout}: {steps} steps (>= {collectives:,} collective instances) on {nodes} nodes, "
              f"rank {victim} slow, to {root} ...", flush=True)
        gt = pipeline_session(root / "work" / "nodes", tp, pp, dp, nodes=nodes, steps=steps,
                              fault="slow-rank", victim=victim)
        truth = {"victim": victim, "steps": steps, "step_ms": gt["step_ms"],
                 "planted_saving_ms": gt["planted_saving_ms"]}
    else:
        print(f"  writing {ranks} ranks x {collectives:,} collectives on {nodes} nodes ({fault}) to {root} ...",
              flush=True)
        scale_session(root / "work" / "nodes", ranks=ranks, collectives=collectives, nodes=nodes,
                      fault=fault, segments_per_node=segs)
    size = sum(f.stat().st_size for f in (root / "work").rglob("*.parquet"))
    done.write_text(json.dumps({"seconds": time.perf_counter() - t, "bytes": size, **truth}))
    print(f"  written in {time.perf_counter() - t:.0f} s, {size / 1e9:.2f} GB", flush=True)
    return root


# ---- one measured run (a child process) -----------------------------------------------

def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(root: Path, ranks: int, collectives: int, nodes: int, fault: str, path: str, layout: str = "",
          window_calls: int = 0, every_step: bool = False) -> dict:
    sys.path.insert(0, str(REPO / "operator"))
    import duckdb

    from bench.synthetic import scale_layout
    from ingero import schema
    from ingero.analysis import analyse, windows
    from ingero.comms import resolve_split_ranks
    from ingero_operator import gather

    if layout:   # one clock; the victim as written
        truth = json.loads((root / "written.json").read_text())
        lay = {"offsets": {}, "victim": truth["victim"], "victim_node": None}
    else:
        lay = scale_layout(ranks, collectives, nodes, fault)
    if every_step:     # no sampled windows, whatever the session holds
        windows.REPLAY_BUDGET = 2**62
    local = gather.LocalSession(root)
    local.artifact.unlink(missing_ok=True)
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kib())
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    rss0 = _rss_kib()
    load0 = os.getloadavg()[0]
    cpu0 = _cpu_s()
    t = time.perf_counter()
    if path == "operator":
        rep, _ = (gather.build_artifact(local, lay["offsets"], window_calls=window_calls) if window_calls
                  else gather.build_artifact(local, lay["offsets"]))
    else:   # the straightforward path: copy every row into trace.duckdb, then SQL
        db = root / "materialized.duckdb"
        db.unlink(missing_ok=True)
        con = duckdb.connect(str(db))
        schema.create_all(con)
        for table in schema.EVENT_TABLES:
            gather._insert(con, table, gather._sources(local, table, lay["offsets"]))
        gather._load_state(con, local, lay["offsets"])
        resolve_split_ranks(con)
        rep = analyse(con)
        con.close()
        db.unlink()
    secs = time.perf_counter() - t
    cpu = _cpu_s() - cpu0
    stop.set()
    peak[0] = max(peak[0], _rss_kib())
    s = rep.straggler
    if fault == "slow-rank":
        ok = s is not None and s.rank == lay["victim"] and s.cause == "compute/unknown"
    elif fault == "lossy-link":
        ok = s is not None and s.node == lay["victim_node"] and s.cause == "network"
    else:
        ok = s is None
    with duckdb.connect() as con:   # after the measurement: the NCCL rows the session holds
        rows = int(con.execute("SELECT count(*) FROM read_parquet(?)",
                               [str(root / "work" / "nodes" / "*" / "nccl_events" / "*.parquet")]).fetchone()[0])
    return {"path": path, "fault": fault, "seconds": secs, "rows": rows, "cpu_seconds": cpu, "peak_rss_mib": peak[0] / 1024,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_mib": rss0 / 1024, "load_before": load0, "collectives": rep.collectives,
            "verdict_ok": ok, "expected": {"rank": lay["victim"], "node": lay["victim_node"]},
            "straggler": None if s is None else {"rank": s.rank, "node": s.node, "cause": s.cause,
                                                 "group": s.group, "evidence": s.evidence},
            "report": rep.to_dict()}


def _counts(report: dict) -> tuple:
    """A report's counts: per rank its collectives, calls per op and retransmits; the totals."""
    return (report["collectives"], report["retransmits"],
            [(r["rank"], r["collectives"], {k: v["calls"] for k, v in r["per_op"].items()}, r["retransmits"])
             for r in report["ranks"]])


def _verdict(report: dict) -> tuple | None:
    s = report["straggler"]
    return None if s is None else (s["kind"], s["rank"], s["node"], s["cause"])


def run_child(root: Path, ranks: int, collectives: int, nodes: int, fault: str, path: str,
              layout: str = "", repo: Path = REPO, window_calls: int = 0, every_step: bool = False) -> dict:
    """One measured run in a fresh process, of the code in `repo` (this checkout, or --baseline's)."""
    more = (["--window-calls", str(window_calls)] if window_calls else []) + (["--every-step"] if every_step else [])
    out = subprocess.run([sys.executable, "-m", "bench.analysis_scale", "--child", str(root.resolve()), "--ranks",
                          str(ranks), "--collectives", str(collectives), "--nodes", str(nodes),
                          "--faults", fault, "--path", path, "--layout", layout, *more],
                         cwd=repo, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def window_reads(root: Path, ranks: int, collectives: int, nodes: int, fault: str, windows: int,
                 repeat: int) -> dict:
    """CPU seconds (all threads) of one window's DuckDB reads (the calls, coverage, runqueue
    tails) of the middle 1/`windows` of the session: through the merged views with a time
    predicate, and from only the segments in range (the operator's windows), alternating;
    and of binding nccl_events (a query's fixed cost): the whole view, a window's."""
    import warnings

    sys.path.insert(0, str(REPO / "operator"))
    import duckdb

    from bench.synthetic import scale_layout
    from ingero import schema
    from ingero.analysis.calls import load
    from ingero.analysis.coverage import coverage
    from ingero.analysis.stats import runqueue_tails
    from ingero.analysis.windows import events_between
    from ingero.comms import resolve_split_ranks
    from ingero_operator import gather

    warnings.simplefilter("ignore", UserWarning)
    offsets = scale_layout(ranks, collectives, nodes, fault)["offsets"]
    local = gather.LocalSession(root)
    con = duckdb.connect()
    con.execute("SET parquet_metadata_cache = true")
    con.execute("SET file_search_path = ?", [str(local.root.resolve())])
    schema.create_all(con)
    gather._load_state(con, local, offsets)
    resolve_split_ranks(con)
    views = gather.segment_views(local, offsets)
    views.create(con)
    lo, hi = con.execute("SELECT min(timestamp_ns), max(timestamp_ns) FROM nccl_events").fetchone()
    w = (hi - lo) // windows
    a, b = lo + (windows // 2) * w, lo + (windows // 2 + 1) * w
    cpu: dict = {"merged views": [], "segments in range": []}
    bind: dict = {"the whole view": [], "a window's views, made and bound 3 times": []}
    for _ in range(repeat):
        t = _cpu_s()
        con.execute("SELECT * FROM nccl_events WHERE false").fetchall()
        bind["the whole view"].append(_cpu_s() - t)
        t = _cpu_s()
        with views.between(con, a, b):     # as a window's reads bind them (calls, coverage, tails)
            for _ in range(3):
                con.execute("SELECT * FROM nccl_events WHERE false").fetchall()
        bind["a window's views, made and bound 3 times"].append(_cpu_s() - t)
        for name, between in (("merged views", events_between), ("segments in range", views.between)):
            t = _cpu_s()
            with between(con, a, b):
                c, _ = load(con)
                coverage(con, c.counted)
                runqueue_tails(con)
            cpu[name].append(_cpu_s() - t)
    out = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"  one 1/{windows} window's reads ({c.n:,} calls), median of {repeat}: "
          + ", ".join(f"{k} {v:.2f} CPU-s" for k, v in out.items()) + f"; load {os.getloadavg()[0]:.1f}")
    out["bind"] = {k: statistics.median(v) for k, v in bind.items()}
    print("  binding nccl_events: " + ", ".join(f"{k} {v * 1e3:.0f} CPU-ms" for k, v in out["bind"].items()))
    return out


# ---- the benchmark ---------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="", help="tp=T,pp=P,dp=D: a 3D job (slow-rank only); --ranks is T*P*D")
    ap.add_argument("--ranks", type=int, default=1024)
    # 10,000 by default: the 100,000 (102 M rows) is a ~1 GB session that takes minutes to write
    ap.add_argument("--collectives", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--segments-per-node", type=int, default=8)
    ap.add_argument("--faults", default="slow-rank,lossy-link")
    ap.add_argument("--repeat", type=int, default=3, help="measured runs per fault (median reported)")
    ap.add_argument("--compare-collectives", type=int, default=2_000,
                    help="size of the side-by-side run against the straightforward path (0: skip)")
    ap.add_argument("--data", type=Path, default=REPO / "out" / "bench-data" / "analysis_scale")
    ap.add_argument("--quick", action="store_true", help="64 ranks x 2,000 collectives on 8 nodes, one run")
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. `git worktree add /tmp/base main`): "
                    "each run is followed by the same run of its code on the same segments; reports must be equal")
    ap.add_argument("--every-step", action="store_true", help="each run is followed by one of this checkout "
                    "judging every step (no sampled windows), compared as --baseline's are")
    ap.add_argument("--lengths", default="", help="e.g. 1,4,16: the same job with that many times --collectives "
                    "(steps), one run each (--repeat), to show memory flat and time linear in session length")
    ap.add_argument("--window-calls", type=int, default=0, help="NCCL calls per analysis window "
                    "(default: the operator's, ingero.analysis.windows.WINDOW_CALLS)")
    ap.add_argument("--window-reads", type=int, default=0, metavar="N", help="only the DuckDB reads of one "
                    "1/N window: through the merged views and from the segments in range (CPU-s, --repeat runs)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--path", default="operator", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.ranks, a.collectives, a.nodes, a.faults, a.path, a.layout, a.window_calls,
                               a.every_step), default=str))
        return {}
    if a.quick:
        a.ranks, a.collectives, a.nodes, a.repeat, a.compare_collectives = 64, 2_000, 8, 1, 2_000
    faults = [f for f in a.faults.split(",") if f]
    if a.layout:
        tp, pp, dp = parse_layout(a.layout)
        a.ranks, faults, a.compare_collectives = tp * pp * dp, ["slow-rank"], 0
    rows = a.ranks * a.collectives
    results: dict = {"ranks": a.ranks, "collectives": a.collectives, "nodes": a.nodes, "rows": rows,
                     "segments_per_node": a.segments_per_node, "cpus": os.cpu_count(), "runs": {}}
    if a.layout:
        print(f"analysis_scale: {a.layout} ({a.ranks} ranks), >= {a.collectives:,} collective instances plus "
              f"the pipeline's send/recv, on {a.nodes} nodes; {os.cpu_count()} CPUs")
    else:
        print(f"analysis_scale: {a.ranks} ranks x {a.collectives:,} collectives = {rows:,} NCCL rows on "
              f"{a.nodes} nodes, {a.segments_per_node} segments per node; {os.cpu_count()} CPUs")
    if a.window_reads:
        root = ensure_session(a.data, a.ranks, a.collectives, a.nodes, a.segments_per_node, faults[0], a.layout)
        results["window_reads"] = window_reads(root, a.ranks, a.collectives, a.nodes, faults[0], a.window_reads,
                                               a.repeat)
        return results
    if a.lengths:
        results["lengths"] = _lengths(a, faults[0], [int(k) for k in a.lengths.split(",")])
        return results
    for fault in faults:
        root = ensure_session(a.data, a.ranks, a.collectives, a.nodes, a.segments_per_node, fault, a.layout)
        runs, base = [], []
        for _ in range(a.repeat):     # alternating with the baseline's runs: the same load on both
            runs.append(run_child(root, a.ranks, a.collectives, a.nodes, fault, "operator", a.layout))
            if a.baseline or a.every_step:
                base.append(run_child(root, a.ranks, a.collectives, a.nodes, fault, "operator", a.layout,
                                      repo=a.baseline.resolve() if a.baseline else REPO,
                                      every_step=a.every_step and not a.baseline))
        if a.layout:
            results["rows"] = runs[0]["rows"]
        secs = [r["seconds"] for r in runs]
        peak = max(r["peak_rss_mib"] for r in runs)
        r0 = runs[0]
        res = {"seconds_median": statistics.median(secs), "seconds_min": min(secs), "seconds_max": max(secs),
               "seconds": [round(x, 2) for x in secs],
               "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in runs),
               "peak_rss_mib": peak, "verdict_ok": all(r["verdict_ok"] for r in runs),
               "straggler": r0["straggler"], "expected": r0["expected"],
               "load_before": [round(r["load_before"], 2) for r in runs],
               "written": json.loads((root / "written.json").read_text())}
        results["runs"][fault] = res
        if base:
            b = {"seconds_median": statistics.median(r["seconds"] for r in base),
                 "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in base),
                 "peak_rss_mib": max(r["peak_rss_mib"] for r in base),
                 "reports_equal": all(x["report"] == y["report"] for x, y in zip(runs, base)),
                 "counts_equal": all(_counts(x["report"]) == _counts(y["report"]) for x, y in zip(runs, base)),
                 "same_verdict": all(_verdict(x["report"]) == _verdict(y["report"]) for x, y in zip(runs, base)),
                 "saving_ms": [round((r["report"]["straggler"] or {}).get("saving_ms_per_step", 0.0), 2)
                               for r in base]}
            res["baseline"] = {**b, "repo": str(a.baseline) if a.baseline else "every step judged"}
        print(f"  {fault}: {runs[0]['rows']:,} NCCL rows; gather+merge+analysis {res['seconds_median']:.2f} s median "
              f"(min {res['seconds_min']:.2f}, max {res['seconds_max']:.2f}, {len(runs)} runs; "
              f"{res['cpu_seconds_median']:.1f} CPU-s median), "
              f"peak RSS {peak:,.0f} MiB; verdict {'as planted' if res['verdict_ok'] else 'WRONG'}: "
              f"{r0['straggler']}")
        if base:
            b = res["baseline"]
            print(f"    baseline {b['repo']}: {b['seconds_median']:.2f} s median, {b['cpu_seconds_median']:.1f} CPU-s, "
                  f"peak RSS {b['peak_rss_mib']:,.0f} MiB: this checkout "
                  f"{b['seconds_median'] / res['seconds_median']:.2f}x faster, "
                  f"{b['cpu_seconds_median'] / res['cpu_seconds_median']:.2f}x less CPU, "
                  f"{b['peak_rss_mib'] / peak:.2f}x less memory; reports {'identical' if b['reports_equal'] else 'DIFFER'}"
                  + ("" if b["reports_equal"] else
                     f" (counts per rank and op, retransmits {'equal' if b['counts_equal'] else 'DIFFER'}; "
                     f"straggler and cause {'the same' if b['same_verdict'] else 'DIFFER'}; saving "
                     f"{[round((r['report']['straggler'] or {}).get('saving_ms_per_step', 0.0), 2) for r in runs]} "
                     f"ms/step against {b['saving_ms']})"))
    if a.compare_collectives:
        fault = faults[0]
        root = ensure_session(a.data, a.ranks, a.compare_collectives, a.nodes, a.segments_per_node, fault)
        new = run_child(root, a.ranks, a.compare_collectives, a.nodes, fault, "operator")
        old = run_child(root, a.ranks, a.compare_collectives, a.nodes, fault, "materialize")
        same = new["report"] == old["report"]
        results["side_by_side"] = {
            "rows": a.ranks * a.compare_collectives, "fault": fault, "reports_equal": same,
            "operator": {k: new[k] for k in ("seconds", "peak_rss_mib")},
            "materialize_then_sql": {k: old[k] for k in ("seconds", "peak_rss_mib")},
            "speedup": old["seconds"] / new["seconds"]}
        print(f"  side by side at {a.ranks * a.compare_collectives:,} rows ({fault}): operator path "
              f"{new['seconds']:.2f} s / {new['peak_rss_mib']:,.0f} MiB, copy-into-DuckDB + SQL "
              f"{old['seconds']:.2f} s / {old['peak_rss_mib']:,.0f} MiB ({old['seconds'] / new['seconds']:.1f}x); "
              f"reports {'identical' if same else 'DIFFER'}")
    worst = max(r["seconds_median"] for r in results["runs"].values())
    cpu = max(r["cpu_seconds_median"] for r in results["runs"].values())
    peak = max(r["peak_rss_mib"] for r in results["runs"].values())
    measured = (f"worst median {worst:.2f} s wall at load {os.getloadavg()[0]:.0f}, {cpu:.1f} CPU-s; "
                f"peak {peak:,.0f} MiB")
    if a.layout == "tp=8,pp=8,dp=16" and a.collectives >= 100_000:
        target_s, target_gib = LAYOUT_TARGET_S, LAYOUT_TARGET_GIB
    elif not a.layout and a.ranks == 1024 and a.collectives >= 100_000:
        target_s, target_gib = TARGET_S, TARGET_GIB
    else:
        print(f"  no target at this size ({measured})")
        return results
    results["target"] = {"seconds": target_s, "gib": target_gib}
    results["meets_target"] = worst < target_s and peak < target_gib * 1024
    print(f"  target < {target_s:.0f} s and < {target_gib:.0f} GiB: "
          f"{'met' if results['meets_target'] else 'MISSED'} ({measured})")
    return results


def _lengths(a, fault: str, ks: list[int]) -> dict:
    """The job at k x --collectives for each k: median seconds, CPU seconds and peak RSS, with
    their ratios to the shortest's (memory flat, time linear: ratio of seconds per row near 1)."""
    out = {}
    for k in ks:
        n = a.collectives * k
        root = ensure_session(a.data, a.ranks, n, a.nodes, a.segments_per_node, fault, a.layout)
        runs = [run_child(root, a.ranks, n, a.nodes, fault, "operator", a.layout, window_calls=a.window_calls)
                for _ in range(a.repeat)]
        out[k] = {"rows": runs[0]["rows"], "seconds_median": statistics.median(r["seconds"] for r in runs),
                  "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in runs),
                  "peak_rss_mib": max(r["peak_rss_mib"] for r in runs), "verdict_ok": all(r["verdict_ok"] for r in runs),
                  "load_before": [round(r["load_before"], 2) for r in runs]}
        print(f"  {k}x: {out[k]['rows']:,} rows, {out[k]['seconds_median']:.2f} s median "
              f"({out[k]['cpu_seconds_median']:.1f} CPU-s), peak RSS {out[k]['peak_rss_mib']:,.0f} MiB, verdict "
              f"{'as planted' if out[k]['verdict_ok'] else 'WRONG'}; load {out[k]['load_before']}", flush=True)
    ref = out[ks[0]]
    for k in ks[1:]:
        o = out[k]
        o["memory_ratio"] = o["peak_rss_mib"] / ref["peak_rss_mib"]
        o["cpu_per_row_ratio"] = (o["cpu_seconds_median"] / o["rows"]) / (ref["cpu_seconds_median"] / ref["rows"])
        print(f"  {k}x against {ks[0]}x: memory {o['memory_ratio']:.2f}x, CPU per row {o['cpu_per_row_ratio']:.2f}x")
    return out


if __name__ == "__main__":
    main()
