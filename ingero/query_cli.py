"""`ingero query SOURCE "SQL"`: run SQL on a trace and print a table.

SOURCE is a DuckDB file written by `ingero trace`/`ingero lab` or the
operator (opened read-only), a folder holding one as trace.duckdb (the
operator's artifact folder, a lab --out folder), or a directory of Parquet
segments (exposed as views).

The process is bounded in memory (--max-memory-mb, default 3/4 of the machine's):
a query past it (``SELECT repeat('x', 1073741000)`` on a small bound, a crafted
trace's view) is an error naming the flag, not a machine swapping.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

from ingero import readonly_sql
from ingero.console import print_table
from ingero.errors import IngeroError, duckdb_line
from ingero.readonly_sql import open_source


def add_parser(sub):
    p = sub.add_parser(
        "query",
        help="run SQL on a trace (DuckDB file or segment directory)",
        description=__doc__,
        epilog="examples:\n"
        "  ingero query t.duckdb \"SELECT op, rank, nranks, duration_ns/1e6 AS ms FROM nccl_events "
        "ORDER BY duration_ns DESC LIMIT 20\"\n"
        "  ingero query t.duckdb.segments \"SELECT COUNT(*) FROM tcp_events "
        "WHERE event = 'tcp_retransmit_skb'\"\n"
        "  ingero query t.duckdb --tables",
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument("source", type=Path, help="trace .duckdb file, a folder holding one, or a segment directory")
    p.add_argument("--session", metavar="ID", help="the session to read when a segment folder "
                   "holds several (the error lists them)")
    p.add_argument("sql", nargs="?", help="the query; '-' reads it from stdin")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--max-rows", type=int, default=1000,
                   help="print at most this many rows (default 1000; 0 = all)")
    p.add_argument("--tables", action="store_true", help="list tables with row counts")
    p.add_argument("--max-memory-mb", type=int, default=default_memory_mb(), metavar="MB",
                   help="data memory of this process, DuckDB's included (default 3/4 of the machine's: "
                   f"{default_memory_mb()}; 0: no bound)")
    return p


def default_memory_mb() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 3 // 4 >> 20


def bound_memory(max_memory_mb: int) -> int | None:
    """Bound this process to `max_memory_mb` (0: not at all); DuckDB's share of it in MiB."""
    if not max_memory_mb:
        return None
    if max_memory_mb < 512:
        raise IngeroError(f"--max-memory-mb {max_memory_mb} is too small: use 512 or more (0: no bound)")
    duck = max_memory_mb - readonly_sql.PROCESS_RESERVE_MB
    readonly_sql.bound_process(max_memory_mb, readonly_sql.Limits(memory_mb=duck), 1, "--max-memory-mb")
    return duck


def run(args) -> int:
    import duckdb

    con = open_source(args.source, session=args.session, memory_mb=bound_memory(args.max_memory_mb))
    try:
        if args.tables:
            names = [r[0] for r in con.execute(
                "SELECT table_name FROM information_schema.tables ORDER BY table_name").fetchall()]
            rows = [(n, con.execute(f'SELECT COUNT(*) FROM "{n}"').fetchone()[0]) for n in names]
            print_table(["table", "rows"], rows)
            return 0
        sql = sys.stdin.read() if args.sql == "-" else args.sql
        if not sql or not sql.strip():
            raise IngeroError("no SQL given: ingero query SOURCE \"SELECT ...\" (or --tables)")
        try:
            cur = con.execute(sql)
            if cur.description is None:
                return 0
            names = [d[0] for d in cur.description]
            limit = args.max_rows if args.max_rows > 0 else None
            rows = cur.fetchmany(limit) if limit else cur.fetchall()
            more = bool(limit and cur.fetchone() is not None)
        except (duckdb.OutOfMemoryException, MemoryError) as e:
            raise IngeroError(f"query needs more memory than --max-memory-mb {args.max_memory_mb} allows: "
                              "narrow it (WHERE, LIMIT, smaller values) or raise it") from e
        except duckdb.Error as e:
            raise IngeroError(f"query failed: {duckdb_line(e)}") from e
    finally:
        con.close()
    if args.format == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(names)
        w.writerows(rows)
    elif args.format == "json":
        for r in rows:
            print(json.dumps(dict(zip(names, r)), default=str))
    else:
        print_table(names, rows)
        print(f"({len(rows)} row{'s' if len(rows) != 1 else ''}"
              f"{', more not shown: raise --max-rows' if more else ''})", file=sys.stderr)
    return 0
