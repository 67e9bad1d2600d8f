"""Cost of one live status refresh of a running session, whole session vs recent window.

    python -m bench.live_refresh [--collectives 2000,5000] [--ranks 1024] [--nodes 128]
                                 [--data DIR] [--repeat 2]
    python -m bench.live_refresh --grow 60 [--ranks 64] [--nodes 8] [--step-ms 40]
                                 [--segments-per-minute 30]

While a TraceSession runs, the operator refreshes its status every 2 s
(operator/ingero_operator/gather.py:ingest_and_analyse): new segments into a
live DuckDB, then the analysis. This writes a synthetic session of `--ranks`
ranks (bench.synthetic.scale_session, slow-rank planted) per size, ingests it
once, then times refreshes with nothing new to ingest, first judging the whole
session (`--live-window 0`), then the recent window (the operator's default).
Reports seconds per refresh, the ratio, the peak RSS and whether the planted
rank was named.

`--grow MINUTES` measures a session as it grows instead: it writes MINUTES of a
job (steps of `--step-ms` of 4 collectives, `--segments-per-minute` segments per
node and table a minute; agents roll one every 2 s), then hands the operator's
refresh one more minute of segments at a time (announced as the gather announces
its downloads) with each node's threads as its agent last saw them, with the
operator's default settings, and reports each refresh's time (the new minute's
ingest included) and of one more with nothing new, the process's resident
memory after each (and its peak so far) and the live database's size, at a few
points of the session.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _refresh(local, offsets, window_s) -> tuple[float, object]:
    from ingero_operator.gather import ingest_and_analyse

    t = time.perf_counter()
    rep, _ = ingest_and_analyse(local, offsets, None, window_s)
    return time.perf_counter() - t, rep


def one_size(data: Path, ranks: int, collectives: int, nodes: int, repeat: int, window_s: float) -> dict:
    from bench.synthetic import scale_layout, scale_session
    from ingero_operator.gather import LocalSession

    root = data / f"r{ranks}-c{collectives}-n{nodes}"
    lay = scale_layout(ranks, collectives, nodes, "slow-rank")
    if not (root / "work" / "nodes").is_dir():
        t = time.perf_counter()
        scale_session(root / "work" / "nodes", ranks=ranks, collectives=collectives, nodes=nodes,
                      fault="slow-rank")
        print(f"  wrote {ranks * collectives:,} calls in {time.perf_counter() - t:.1f} s", flush=True)
    local = LocalSession(root)
    local.live_db.unlink(missing_ok=True)
    first, _ = _refresh(local, lay["offsets"], None)                 # ingest everything once
    whole, window = [], []
    for _ in range(repeat):
        dt, rep_w = _refresh(local, lay["offsets"], None)
        whole.append(dt)
    for _ in range(repeat):          # after the whole session's: a windowed refresh drops old rows
        dt, rep_r = _refresh(local, lay["offsets"], window_s)
        window.append(dt)
    out = {"calls": ranks * collectives, "first_refresh_s": first,
           "whole_s": statistics.median(whole), "window_s": statistics.median(window),
           "named_whole": getattr(rep_w.straggler, "rank", None) == lay["victim"],
           "named_window": getattr(rep_r.straggler, "rank", None) == lay["victim"],
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    out["ratio"] = out["whole_s"] / out["window_s"] if out["window_s"] else None
    return out


def _cpu_s() -> float:
    """CPU seconds of this process so far, DuckDB's threads included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _grow_source(data: Path, ranks: int, nodes: int, minutes: int, per_minute: int, step_ms: float):
    """The whole session's segments (written once, then reused) and its layout: the slow
    rank is late by a quarter of the step, well above the verdict's floor at any step."""
    from bench.synthetic import SCALE_STEP, scale_layout, scale_session

    collectives = int(minutes * 60 * 1000 / step_ms) * len(SCALE_STEP)
    src = data / f"grow-r{ranks}-n{nodes}-m{minutes}-s{per_minute}-t{step_ms:g}-late"
    lay = scale_layout(ranks, collectives, nodes, "slow-rank")
    if not src.is_dir():
        t = time.perf_counter()
        tmp = src.with_name(src.name + ".tmp")
        if tmp.exists():
            import shutil
            shutil.rmtree(tmp)
        scale_session(tmp, ranks=ranks, collectives=collectives, nodes=nodes, fault="slow-rank",
                      segments_per_node=minutes * per_minute, step_ms=step_ms, late_ms=step_ms / 4)
        tmp.rename(src)
        print(f"  wrote {ranks * collectives:,} calls in {time.perf_counter() - t:.1f} s", flush=True)
    return src, lay, collectives


def _snapshot_threads(local, lay: dict, ranks: int, nodes: int, at_ns: int) -> None:
    """Each node's nccl_inflight as its agent rewrites it every roll: every rank's thread, seen
    at `at_ns` (the session's clock) sleeping outside NCCL."""
    import pyarrow.parquet as pq

    from bench.synthetic import _scale_node
    from ingero.store import to_arrow

    rpn = ranks // nodes
    for ni in range(nodes):
        node = _scale_node(ni)
        granks = list(range(ni * rpn, (ni + 1) * rpn))
        pids = [1000 + i for i in range(rpn)]
        tbl = to_arrow("nccl_inflight", {"node": [node] * rpn, "session_id": ["scale"] * rpn, "pid": pids,
                                         "tid": pids, "rank": granks, "seen_ns": [at_ns + lay["offsets"][node]] * rpn,
                                         "state": ["S"] * rpn}, rpn)
        d = local.node_dir(node) / "nccl_inflight"
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(tbl, d / ".snapshot.tmp")
        os.replace(d / ".snapshot.tmp", d / f"{node}__scale.parquet")


def grow(data: Path, ranks: int, nodes: int, minutes: int, per_minute: int = 30, step_ms: float = 40.0,
         report_at=(1, 2, 5, 10, 20, 30, 45, 60), every: int = 1) -> list:
    """Refresh a session that grows by one minute of segments per refresh (see the module's
    docstring); returns a row per reported minute. `every` > 1: between reported minutes,
    refresh only every this many minutes (each such refresh ingests them all), and on the
    minute before a reported one, whose refresh then ingests one minute."""
    from bench.synthetic import SCALE_T0
    from ingero_operator.gather import LocalSession
    from ingero_operator.settings import TimingSettings

    src, lay, collectives = _grow_source(data, ranks, nodes, minutes, per_minute, step_ms)
    by_minute: dict[int, list[Path]] = {}
    for f in src.rglob("*.parquet"):
        seg = f.stem.rsplit("__", 1)[-1]
        by_minute.setdefault(int(seg) // per_minute + 1 if seg.isdigit() else 1, []).append(f)
    timing = TimingSettings()
    live = data / f"grow-live-{src.name}"
    if live.exists():
        import shutil
        shutil.rmtree(live)
    local = LocalSession(live)
    rows = []
    for minute in range(1, minutes + 1):
        for f in by_minute.get(minute, []):                   # this minute's segments, as the gather writes them
            rel = f.relative_to(src)
            dst = local.work / "nodes" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dst)
            local.announce(rel.parts[0], rel.parts[1], f.name)
        _snapshot_threads(local, lay, ranks, nodes, SCALE_T0 + minute * 60_000_000_000)
        reported = minute in report_at or minute == minutes
        if not reported and minute % every and minute + 1 not in report_at:
            continue
        t, c = time.perf_counter(), _cpu_s()
        rep, _ = ingest_and_analyse_default(local, lay["offsets"], timing)
        dt, dc = time.perf_counter() - t, _cpu_s() - c
        if reported:
            rss = _rss_mib()
            t, c = time.perf_counter(), _cpu_s()
            ingest_and_analyse_default(local, lay["offsets"], timing)      # nothing new
            idle, idle_cpu = time.perf_counter() - t, _cpu_s() - c
            row = {"minute": minute, "calls": ranks * collectives * minute // minutes, "refresh_s": dt,
                   "refresh_cpu_s": dc, "idle_refresh_s": idle, "idle_refresh_cpu_s": idle_cpu,
                   "rss_mib": rss, "idle_rss_mib": _rss_mib(),
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "live_db_mib": local.live_db.stat().st_size / 2**20,
                   "files": sum(1 for _ in (local.work / "nodes").rglob("*.parquet")),
                   "verdict": rep.verdict, "named": getattr(rep.straggler, "rank", None) == lay["victim"]}
            rows.append(row)
            print(f"  minute {minute:>3}: {row['calls']:>11,} calls in {row['files']:,} files, refresh "
                  f"{dt:.2f} s, {dc:.2f} CPU-s (with nothing new {idle:.2f} s, {idle_cpu:.2f} CPU-s), RSS {rss:,.0f} / {row['idle_rss_mib']:,.0f} MiB "
                  f"(peak so far {row['peak_rss_mib']:,.0f}), live db {row['live_db_mib']:,.0f} MiB, "
                  f"verdict {rep.verdict}, planted rank named: {row['named']}", flush=True)
    return rows


def ingest_and_analyse_default(local, offsets, timing):
    from ingero_operator.gather import ingest_and_analyse

    return ingest_and_analyse(local, offsets, None, timing.live_window_s)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collectives", default="2000,5000", help="sizes: collectives per rank, comma-separated")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--window", type=float, default=6.0, help="live window, seconds (the operator's default)")
    ap.add_argument("--data", type=Path, default=REPO / "out" / "bench-data" / "live_refresh")
    ap.add_argument("--quick", action="store_true", help="64 ranks x 2,000 collectives")
    ap.add_argument("--grow", type=int, metavar="MINUTES",
                    help="refresh a session growing one minute at a time, up to MINUTES")
    ap.add_argument("--segments-per-minute", type=int, default=30,
                    help="with --grow: segments per node and table per minute (agents roll every 2 s: 30)")
    ap.add_argument("--report-at", default="1,2,5,10,20,30,45,60",
                    help="with --grow: the minutes reported, comma-separated")
    ap.add_argument("--every", type=int, default=1,
                    help="with --grow: between reported minutes, refresh only every this many minutes")
    ap.add_argument("--step-ms", type=float, default=40.0,
                    help="with --grow: step length (4 collectives a step: 40 ms is 100 calls/s per rank)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "operator"))
    if a.grow:
        print(f"live_refresh --grow: {a.ranks} ranks on {a.nodes} nodes, {a.grow} minutes, steps of "
              f"{a.step_ms:g} ms ({4000 / a.step_ms:g} calls/s per rank), one minute of segments per refresh")
        report_at = tuple(int(x) for x in a.report_at.split(",") if x)
        return {"grow": grow(a.data, a.ranks, a.nodes, a.grow, a.segments_per_minute, a.step_ms, report_at, a.every)}
    if a.quick:
        a.ranks, a.nodes, a.collectives = 64, 8, "2000"
    try:
        sizes = [int(x) for x in a.collectives.split(",") if x]
    except ValueError:
        ap.error(f"--collectives {a.collectives!r}: pass numbers separated by commas")
    results = {}
    print(f"live_refresh: {a.ranks} ranks on {a.nodes} nodes, window {a.window:g} s, "
          f"{a.repeat} refreshes each way, nothing new to ingest")
    for c in sizes:
        r = one_size(a.data, a.ranks, c, a.nodes, a.repeat, a.window)
        results[c] = r
        print(f"  {r['calls']:>11,} calls: whole session + window {r['whole_s']:.2f} s, window only "
              f"{r['window_s']:.2f} s ({r['ratio']:.1f}x); planted rank named: "
              f"{r['named_whole']}/{r['named_window']}; first refresh (ingest) {r['first_refresh_s']:.1f} s; "
              f"peak RSS {r['peak_rss_gib']:.2f} GiB", flush=True)
    return results


if __name__ == "__main__":
    main()
