"""The published slow-collective join on SQLite vs DuckDB, same data, same query text.

    python -m bench.sqlite_vs_duckdb [--events 10000000] [--repeat 3]

SQLite is the file format the original Ingero tool uses. Both engines get the
same rows: `--events` in all, 90% NCCL calls (half of them ALL_REDUCE, 2% of
those slow) and 10% TCP events (half retransmits), spread over one hour of
a 64-rank job. DuckDB gets no index. SQLite is measured twice:

* plain tables, as the query finds them (SQLite plans a nested loop with an
  automatic index on `event` only, so its time grows with slow x tcp rows);
  a run longer than `--sqlite-cap` seconds is stopped and reported as a
  lower bound (">= N x");
* with the indexes that suit this query best ((event, timestamp_ns) on
  tcp_events, (op, duration_ns) on nccl_events): SQLite at its best.

Times are the median of `--repeat` runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from bench.published import SLOW_COLLECTIVE_JOIN


HOUR_NS = 3_600_000_000_000


def make_data(events: int, seed: int = 3) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    n_nccl = int(events * 0.9)
    n_tcp = events - n_nccl
    t0 = 1_750_000_000_000_000_000
    op = np.where(rng.random(n_nccl) < 0.5, "ALL_REDUCE", "ALL_GATHER")
    slow = rng.random(n_nccl) < 0.02
    dur = np.where(slow, rng.integers(50_000_001, 400_000_000, n_nccl),
                   rng.integers(100_000, 20_000_000, n_nccl))
    nccl = {"timestamp_ns": np.sort(t0 + rng.integers(0, HOUR_NS, n_nccl)), "duration_ns": dur,
            "op": op, "rank": rng.integers(0, 64, n_nccl).astype(np.int32),
            "nranks": np.full(n_nccl, 64, np.int32),
            "comm_id_hash": rng.integers(0, 4, n_nccl).astype(np.int64),
            "pid": rng.integers(1000, 1064, n_nccl).astype(np.int32)}
    tcp = {"timestamp_ns": np.sort(t0 + rng.integers(0, HOUR_NS, n_tcp)),
           "event": np.where(rng.random(n_tcp) < 0.5, "tcp_retransmit_skb", "inet_sock_set_state"),
           "rank": rng.integers(0, 64, n_tcp).astype(np.int32)}
    return nccl, tcp


def _capped(lite, cap_s: float) -> tuple[float, list | None]:
    """One run of the query on SQLite, interrupted after cap_s seconds."""
    t = time.perf_counter()
    lite.set_progress_handler(lambda: int(time.perf_counter() - t > cap_s), 100_000)
    try:
        rows = lite.execute(SLOW_COLLECTIVE_JOIN).fetchall()
    except sqlite3.OperationalError:  # interrupted
        rows = None
    finally:
        lite.set_progress_handler(None, 0)
    return time.perf_counter() - t, rows


def _timed(fn, repeat: int) -> tuple[float, list]:
    rows = fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        rows = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sqlite-cap", type=float, default=300.0,
                    help="stop the plain-SQLite run after this many seconds (default 300)")
    a = ap.parse_args(argv)
    nccl, tcp = make_data(a.events)
    with tempfile.TemporaryDirectory() as d:
        ddb = duckdb.connect(str(Path(d) / "t.duckdb"))
        for name, cols in (("nccl_events", nccl), ("tcp_events", tcp)):
            ddb.register("src", pa.table(cols))
            ddb.execute(f"CREATE TABLE {name} AS SELECT * FROM src")
            ddb.unregister("src")
        lite = sqlite3.connect(str(Path(d) / "t.sqlite"))
        for name, cols in (("nccl_events", nccl), ("tcp_events", tcp)):
            names = list(cols)
            lite.execute(f"CREATE TABLE {name} ({', '.join(names)})")
            rows = zip(*(cols[c].tolist() for c in names))
            lite.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(names))})", rows)
        lite.commit()
        t_duck, r_duck = _timed(lambda: ddb.execute(SLOW_COLLECTIVE_JOIN).fetchall(), a.repeat)
        t_plain, r_plain = _capped(lite, a.sqlite_cap)
        lite.execute("CREATE INDEX tcp_ev_ts ON tcp_events(event, timestamp_ns)")
        lite.execute("CREATE INDEX nccl_op_dur ON nccl_events(op, duration_ns)")
        lite.commit()
        t_idx, r_idx = _timed(lambda: lite.execute(SLOW_COLLECTIVE_JOIN).fetchall(), a.repeat)

    def key(rows):
        return [(r[0], round(r[1], 6), r[2]) for r in rows]

    same = key(r_duck) == key(r_idx) and (r_plain is None or key(r_plain) == key(r_duck))
    r = {"events": a.events, "duckdb_s": t_duck, "sqlite_plain_s": t_plain,
         "sqlite_plain_finished": r_plain is not None, "sqlite_indexed_s": t_idx,
         "ratio_plain": t_plain / t_duck, "ratio_indexed": t_idx / t_duck, "same_answer": same}
    bound = "" if r_plain is not None else ">= "
    print(f"slow-collective join on {a.events:,} events: DuckDB {t_duck:.3f} s; "
          f"SQLite plain {bound}{t_plain:.1f} s = {bound}{r['ratio_plain']:.0f}x; "
          f"SQLite indexed {t_idx:.3f} s = {r['ratio_indexed']:.1f}x (target >= 50x); "
          f"same answer: {same}")
    return r


if __name__ == "__main__":
    main()
