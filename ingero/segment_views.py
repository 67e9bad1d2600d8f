"""Event tables as views over segment files, each file's clocks shifted by its node's offset.

The operator's artifact (``trace.duckdb`` in a session folder) does not copy the NCCL
calls and operations and the scheduler events (nearly all rows): ``nccl_events``,
``nccl_profiler_events`` and ``sched_events`` are views over the node segments kept
beside it, named relative to the folder, and the table ``segments`` lists those files
(one row each: its table, file, clock offset, first and last ``timestamp_ns`` on the
session's clock from its row groups' statistics, rows, and the columns it holds).

A view is ONE ``read_parquet`` over its files. Each row's clock columns are shifted by
its file's offset, picked from a list by the scan's ``file_index``; a column no file
holds reads as a typed NULL. ``union_by_name`` is asked for only when the files' columns
differ: with it, DuckDB reads every file's schema each time it binds the view (~0.13 ms a
file, 10x the plain list). A window of the analysis (``analyse_trace``) reads only the
files whose time range meets it, through views made for that window, whose scan also
skips the rows outside the window by their unshifted time (a bound pushed into the
Parquet reader). The operator copies the tables it does not view (and the live status's
rows) through the same ``scan``. ``nccl_events`` takes grown communicators' identities and
resolved split ranks from ``comms``, read once per ``SegmentViews``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from ingero import schema
from ingero.analysis import Report
from ingero.analysis.windows import WINDOW_CALLS, analyse_windows, events_where
from ingero.comms import grow_links, with_grow_ids, with_split_ranks
from ingero.errors import IngeroError
from ingero.store import sql_list

VIEWS = ("nccl_events", "nccl_profiler_events", "sched_events")
TABLE = "segments"
DDL = (f"CREATE TABLE {TABLE} (tbl VARCHAR, file VARCHAR, offset_ns BIGINT, first_ns BIGINT, last_ns BIGINT, "
       "rows BIGINT, columns STRUCT(name VARCHAR, type VARCHAR)[])")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One segment file as a view reads it."""

    file: str                            # relative to the session folder
    offset_ns: int                       # its node's clock offset (subtracted)
    first_ns: int | None                 # earliest and latest timestamp_ns, shifted (None: unknown)
    last_ns: int | None
    rows: int
    columns: tuple[tuple[str, str], ...]  # (name, Arrow type) of the columns it holds

    def meets(self, lo: int, hi: int | None) -> bool:
        """Whether its time range meets [lo, hi) (hi None: to the end)."""
        return (self.last_ns is None or self.last_ns >= lo) and (self.first_ns is None or hi is None
                                                                  or self.first_ns < hi)


def describe(path: Path, file: str, offset_ns: int) -> Segment:
    """A segment from its file's footer: `file` the name views use, `offset_ns` its node's."""
    import pyarrow.parquet as pq

    md = pq.read_metadata(path)
    names = md.schema.names
    cols = tuple((f.name, str(f.type)) for f in md.schema.to_arrow_schema())
    at = names.index("timestamp_ns") if "timestamp_ns" in names else -1
    stats = [md.row_group(i).column(at).statistics for i in range(md.num_row_groups)] if at >= 0 else []
    known = [s for s in stats if s is not None and s.has_min_max]
    if not md.num_rows or not known or len(known) < len(stats):
        return Segment(file, int(offset_ns), None, None, md.num_rows, cols)
    return Segment(file, int(offset_ns), min(s.min for s in known) - offset_ns, max(s.max for s in known) - offset_ns,
                   md.num_rows, cols)


def scan(table: str, segs: list[Segment], folder: Path | None = None,
         lo: int | None = None, hi: int | None = None) -> str | None:
    """SQL of the rows of `segs` as `table`'s columns (any table of the schema), clocks
    shifted (None: no file). Files are named relative to the session folder, or under
    `folder`. `lo`, `hi`: skip rows whose unshifted time is outside every file's [lo, hi)
    (a bound the Parquet reader applies; the caller still filters on the shifted time)."""
    if not segs:
        return None
    offs = [s.offset_ns for s in segs]
    files = sql_list([folder / s.file if folder else s.file for s in segs])
    if len({s.columns for s in segs}) > 1:
        files += ", union_by_name = true"
    src = f"read_parquet({files})"
    shift = schema.CLOCK_COLUMNS.get(table, ())
    off = f"({offs[0]})"
    if shift and len(set(offs)) > 1:   # each row's file's (file_index numbers the files of the list from 0)
        off = "r._offset_ns"
        src = f"(SELECT *, ([{', '.join(map(str, offs))}]::BIGINT[])[file_index::BIGINT + 1] AS _offset_ns FROM {src})"
    have = {c for s in segs for c, _ in s.columns}
    sel = ", ".join((f'r."{c}"::{ty} - {off} AS "{c}"' if c in shift else f'r."{c}"::{ty} AS "{c}"')
                    if c in have else f'NULL::{ty} AS "{c}"' for c, ty in schema.TABLES[table].columns)
    bounds = []
    if "timestamp_ns" in have and "timestamp_ns" in shift:
        if lo is not None:
            bounds.append(f'r."timestamp_ns" >= {int(lo) + min(offs)}')
        if hi is not None:
            bounds.append(f'r."timestamp_ns" < {int(hi) + max(offs)}')
    return f"SELECT {sel} FROM {src} r" + (f" WHERE {' AND '.join(bounds)}" if bounds else "")


@dataclasses.dataclass
class SegmentViews:
    """The segments of each event table a view reads, and the folder they are relative to."""

    folder: Path                          # absolute
    tables: dict[str, list[Segment]]      # every table of VIEWS
    # what nccl_events' rows take from the communicators (final once the views exist): the
    # grow links, and whether a split child's rank is known; read once, by `_body`
    _comms: tuple[list[tuple[int, int, int]], bool] | None = dataclasses.field(default=None, init=False, repr=False)

    def _body(self, con, table: str, rows: str | None) -> str | None:
        """`table`'s rows `rows` (SQL; None: none) as the view shows them: for nccl_events,
        with grown communicators' identities and resolved split ranks (what resolve_grow_ids and
        resolve_split_ranks UPDATE in a table) from `con`'s comms."""
        if rows is None or table != "nccl_events":
            return rows
        if self._comms is None:
            split = con.execute("SELECT count(*) FROM comms WHERE op = 'COMM_SPLIT' AND rank >= 0").fetchone()[0]
            self._comms = grow_links(con), bool(split)
        links, split = self._comms
        rows = with_grow_ids(rows, links)
        return with_split_ranks(rows) if split else rows

    def create(self, con) -> None:
        """Replace the event tables of `con` by views over the segments, named relative to
        the folder (which must be `con`'s file_search_path), and list them in `segments`."""
        import pyarrow as pa

        con.execute(DDL)
        rows = [(t, s) for t in VIEWS for s in self.tables[t]]
        con.register("_segments_rows", pa.table({
            "tbl": [t for t, _ in rows], "file": [s.file for _, s in rows],
            "offset_ns": pa.array([s.offset_ns for _, s in rows], pa.int64()),
            "first_ns": pa.array([s.first_ns for _, s in rows], pa.int64()),
            "last_ns": pa.array([s.last_ns for _, s in rows], pa.int64()),
            "rows": pa.array([s.rows for _, s in rows], pa.int64()),
            "columns": pa.array([[{"name": c, "type": ty} for c, ty in s.columns] for _, s in rows],
                                pa.list_(pa.struct([("name", pa.string()), ("type", pa.string())])))}))
        con.execute(f"INSERT INTO {TABLE} SELECT * FROM _segments_rows")
        con.unregister("_segments_rows")
        for table in VIEWS:
            con.execute(f"DROP TABLE {table}")
            rows_sql = self._body(con, table, scan(table, self.tables[table]))
            con.execute(f"CREATE VIEW {table} AS {rows_sql}" if rows_sql else schema.TABLES[table].ddl())

    @classmethod
    def stored(cls, con) -> SegmentViews | None:
        """The segments the trace open on `con` lists (an operator's artifact), named under
        the trace file's folder; None where it lists none (a trace of another kind, an older
        artifact). A name outside that folder is an IngeroError."""
        path, = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
        if not path or not con.execute(
                "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
                "AND schema_name = 'main' AND table_name = ?", [TABLE]).fetchone()[0]:
            return None
        folder = Path(path).resolve().parent
        tables: dict[str, list[Segment]] = {t: [] for t in VIEWS}
        for t, file, off, first, last, n, cols in con.execute(
                f"SELECT tbl, file, offset_ns, first_ns, last_ns, rows, columns FROM {TABLE} ORDER BY rowid").fetchall():
            p = (folder / str(file)).resolve()
            if not p.is_relative_to(folder):
                raise IngeroError(f"{path}: its table {TABLE} names {str(file)[:200]!r}, outside the trace's folder: "
                                  "not an artifact of the operator (rebuild it from the segments with `ingero merge`)")
            if t in tables:
                tables[t].append(Segment(str(p.relative_to(folder)), int(off), first, last, int(n),
                                         tuple((c["name"], c["type"]) for c in cols or ())))
        return cls(folder, tables)

    def extent(self) -> tuple[int, int | None, int | None] | None:
        """nccl_events' (rows, first and last timestamp_ns) from the footers; None when a
        footer has no statistics of timestamp_ns."""
        segs = [s for s in self.tables["nccl_events"] if s.rows]
        firsts = [s.first_ns for s in segs if s.first_ns is not None]
        lasts = [s.last_ns for s in segs if s.last_ns is not None]
        if len(firsts) < len(segs) or len(lasts) < len(segs):
            return None
        return sum(s.rows for s in segs), min(firsts, default=None), max(lasts, default=None)

    @contextlib.contextmanager
    def between(self, con, lo: int, hi: int | None):
        """For ``analyse_windows``: shadow the event tables with their rows from `lo` to `hi`
        (None: to the end), read from only the segments whose time range meets that one
        (each query over the whole view opens every segment: ~0.2 ms per file and query)."""
        where = f"timestamp_ns >= {int(lo)}" + ("" if hi is None else f" AND timestamp_ns < {int(hi)}")
        rows = {}
        for table, segs in self.tables.items():
            rows_sql = self._body(con, table, scan(table, [s for s in segs if s.meets(lo, hi)], self.folder, lo, hi))
            rows[table] = f"SELECT * FROM ({rows_sql}) WHERE {where}" if rows_sql else None
        with events_where(con, where, rows) as (db, shadowed):
            yield db, shadowed


def analyse_trace(con, slow_collective_ms: float | None = None, window_calls: int = WINDOW_CALLS,
                  views: SegmentViews | None = None) -> Report:
    """The trace on `con` judged in windows (``analyse_windows``), each window reading only
    the segments in its range where the trace lists them (`views`, or those it stores)."""
    views = views or SegmentViews.stored(con)
    if views is None:
        return analyse_windows(con, slow_collective_ms, window_calls)
    return analyse_windows(con, slow_collective_ms, window_calls, between=views.between, extent=views.extent())
