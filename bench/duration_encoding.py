"""Parquet encodings for duration_ns: size and decode time, side by side in one run.

    python -m bench.duration_encoding [--rows 10000000] [--repeat 3]

Durations are nearly all distinct, so a dictionary does not pay. This writes
the same log-normal durations (median ~3 ms, like collectives) with zstd as
the segment writer does, once per encoding, and reads the column back with
DuckDB (one thread, best of --repeat) and pyarrow. The writer uses delta
(ingero/store.py): byte-stream-split is read for integers only by DuckDB >= 2.0.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

ENCODINGS = {
    "dictionary": {"use_dictionary": True},
    "plain": {"use_dictionary": False},
    "delta": {"use_dictionary": False, "column_encoding": {"duration_ns": "DELTA_BINARY_PACKED"}},
    "byte-stream-split": {"use_dictionary": False, "column_encoding": {"duration_ns": "BYTE_STREAM_SPLIT"}},
}


def main(argv=None) -> dict:
    import duckdb
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    if a.rows <= 0 or a.repeat <= 0:
        ap.error("--rows and --repeat must be > 0")
    d = np.random.default_rng(1).lognormal(15, 1.0, a.rows).astype(np.int64)
    table = pa.table({"duration_ns": d})
    out = {}
    print(f"duration_encoding: {a.rows:,} durations, zstd level 3, row groups of 1 M")
    with tempfile.TemporaryDirectory() as tmp:
        for name, opts in ENCODINGS.items():
            f = Path(tmp) / f"{name}.parquet"
            pq.write_table(table, f, compression="zstd", compression_level=3, row_group_size=1 << 20, **opts)
            con = duckdb.connect()
            con.execute("SET threads = 1")
            ddb = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                con.execute(f"SELECT sum(duration_ns) FROM '{f}'").fetchall()
                ddb.append(time.perf_counter() - t)
            con.close()
            pya = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                pq.read_table(f)
                pya.append(time.perf_counter() - t)
            out[name] = {"mb": os.path.getsize(f) / 1e6, "duckdb_s": min(ddb), "pyarrow_s": min(pya)}
            print(f"  {name:18s} {out[name]['mb']:6.1f} MB   DuckDB 1 thread {min(ddb):.3f} s   "
                  f"pyarrow {min(pya):.3f} s", flush=True)
    return out


if __name__ == "__main__":
    main()
