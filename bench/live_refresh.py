"""Cost of one live status refresh of a running session, whole session vs recent window.

    python -m bench.live_refresh [--collectives 2000,5000] [--ranks 1024] [--nodes 128]
                                 [--data DIR] [--repeat 2]
    python -m bench.live_refresh --grow 60 [--ranks 64] [--nodes 8]

While a TraceSession runs, the operator refreshes its status every 2 s
(operator/ingero_operator/gather.py:ingest_and_analyse): new segments into a
live DuckDB, then the analysis. This writes a synthetic session of `--ranks`
ranks (bench.synthetic.scale_session, slow-rank planted) per size, ingests it
once, then times refreshes with nothing new to ingest, the two ways side by
side in one process: analysing the whole session plus the recent window
(what the operator does up to TimingSettings.live_full_max_calls NCCL calls)
and the recent window alone (what it does above). Reports seconds per
refresh, the ratio, the peak RSS and whether the planted rank was named.

`--grow MINUTES` measures a session as it grows instead: it writes MINUTES of a
job (40 ms steps of 4 collectives, a segment per node and table every 2 s, as
agents roll them), then hands the operator's refresh one more minute of
segments at a time (announced as the gather announces its downloads), with the
operator's default settings, and reports each refresh's time (the new minute's
ingest included) and of one more with nothing new, the process's resident
memory after them and the live database's size, at a few points of the session.
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


def _refresh(local, offsets, window_s, full_max) -> tuple[float, object]:
    from ingero_operator.gather import ingest_and_analyse

    t = time.perf_counter()
    rep, _ = ingest_and_analyse(local, offsets, None, window_s, full_max)
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
    first, _ = _refresh(local, lay["offsets"], window_s, None)       # ingest everything once
    whole, window = [], []
    for _ in range(repeat):                                          # alternate the two ways
        dt, rep_w = _refresh(local, lay["offsets"], window_s, None)
        whole.append(dt)
        dt, rep_r = _refresh(local, lay["offsets"], window_s, 0)
        window.append(dt)
    out = {"calls": ranks * collectives, "first_refresh_s": first,
           "whole_s": statistics.median(whole), "window_s": statistics.median(window),
           "named_whole": getattr(rep_w.straggler, "rank", None) == lay["victim"],
           "named_window": getattr(rep_r.straggler, "rank", None) == lay["victim"],
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    out["ratio"] = out["whole_s"] / out["window_s"] if out["window_s"] else None
    return out


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def grow(data: Path, ranks: int, nodes: int, minutes: int, per_minute: int = 30,
         report_at=(1, 2, 5, 10, 20, 30, 45, 60)) -> list:
    """Refresh a session that grows by one minute of segments per refresh (see the module's
    docstring); returns a row per reported minute."""
    from bench.synthetic import scale_layout, scale_session
    from ingero_operator.gather import LocalSession
    from ingero_operator.settings import TimingSettings

    collectives = minutes * 60 * 1000 // 40 * 4            # 40 ms steps of 4 collectives
    src = data / f"grow-r{ranks}-n{nodes}-m{minutes}-s{per_minute}"
    lay = scale_layout(ranks, collectives, nodes, "slow-rank")
    if not src.is_dir():
        t = time.perf_counter()
        scale_session(src, ranks=ranks, collectives=collectives, nodes=nodes, fault="slow-rank",
                      segments_per_node=minutes * per_minute)
        print(f"  wrote {ranks * collectives:,} calls in {time.perf_counter() - t:.1f} s", flush=True)
    by_minute: dict[int, list[Path]] = {}
    for f in src.rglob("*.parquet"):
        seg = f.stem.rsplit("__", 1)[-1]
        by_minute.setdefault(int(seg) // per_minute + 1 if seg.isdigit() else 1, []).append(f)
    timing = TimingSettings()
    live = data / f"grow-live-r{ranks}-n{nodes}-m{minutes}-s{per_minute}"
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
        t = time.perf_counter()
        rep, _ = ingest_and_analyse_default(local, lay["offsets"], timing)
        dt = time.perf_counter() - t
        if minute in report_at or minute == minutes:
            t = time.perf_counter()
            ingest_and_analyse_default(local, lay["offsets"], timing)      # nothing new
            idle = time.perf_counter() - t
            row = {"minute": minute, "calls": ranks * collectives * minute // minutes, "refresh_s": dt,
                   "idle_refresh_s": idle,
                   "rss_mib": _rss_mib(), "live_db_mib": local.live_db.stat().st_size / 2**20,
                   "files": sum(1 for _ in (local.work / "nodes").rglob("*.parquet")),
                   "named": getattr(rep.straggler, "rank", None) == lay["victim"]}
            rows.append(row)
            print(f"  minute {minute:>3}: {row['calls']:>11,} calls in {row['files']:,} files, refresh "
                  f"{dt:.2f} s (with nothing new {idle:.2f} s), RSS {row['rss_mib']:,.0f} MiB, live db {row['live_db_mib']:,.0f} MiB, "
                  f"planted rank named: {row['named']}", flush=True)
    return rows


def ingest_and_analyse_default(local, offsets, timing):
    from ingero_operator.gather import ingest_and_analyse

    return ingest_and_analyse(local, offsets, None, timing.live_window_s, timing.live_full_max_calls)


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
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "operator"))
    if a.grow:
        print(f"live_refresh --grow: {a.ranks} ranks on {a.nodes} nodes, {a.grow} minutes, "
              "one minute of segments per refresh")
        return {"grow": grow(a.data, a.ranks, a.nodes, a.grow, a.segments_per_minute)}
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
