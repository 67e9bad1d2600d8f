"""Segments on disk: the writer the agent uses, and the readers everything else uses.

Layout of a segment directory (one per node and trace)::

    <seg_dir>/<table>/<node>__<session>__<n:06d>.parquet   event tables, one file per roll
    <seg_dir>/<table>/<node>__<session>.parquet            state tables, replaced on each flush

Every file is written to a temporary name and renamed, so a reader (or an
agent restarted mid-session) never sees half a segment, and segments already
on disk survive a crash of the writer. Event ids are node-namespaced
(``schema.node_prefix``) and resume after the highest id already on disk.

Parquet settings are chosen for size at little CPU: zstd level 3, dictionary
encoding for strings and low-cardinality integers, delta encoding for
monotonically growing integers (timestamps, ids, seq) and for durations
(nearly every value distinct: a dictionary of them is as large as the column
and the slowest column to decode; delta-packed they decode at about a third of
the CPU, docs/benchmarks.md "Gather, merge and analysis at scale").
BYTE_STREAM_SPLIT would pack durations a little smaller, but DuckDB reads it
for integers only from 2.0, and segments must stay readable by the DuckDB
(and other Parquet readers) users already have.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ingero import schema
from ingero.comms import resolve_split_ranks
from ingero.errors import IngeroError

# Strings are dictionary-encoded in memory too: the agent hands over small
# integer codes plus a dictionary (see ``dict_column``), which costs nothing
# to convert; Parquet stores them as plain strings that DuckDB reads as VARCHAR.
_ARROW_TYPES = {
    "VARCHAR": pa.dictionary(pa.int32(), pa.string()),
    "BIGINT": pa.int64(),
    "UBIGINT": pa.uint64(),
    "INTEGER": pa.int32(),
    "BOOLEAN": pa.bool_(),
}
# Delta-encoded instead of dictionary: columns that grow steadily within a segment, and
# durations (nearly all distinct; DuckDB decodes them ~3x faster than dictionary pages:
# bench/duration_encoding.py).
_DELTA_COLUMNS = {"event_id", "timestamp_ns", "ts_mono_ns", "seq", "duration_ns"}
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def arrow_schema(table: str) -> pa.Schema:
    t = schema.TABLES[table]
    return pa.schema([(c, _ARROW_TYPES[ty]) for c, ty in t.columns])


def _safe(name: str) -> str:
    return _SAFE_NAME.sub("_", name)


def to_arrow(table: str, columns: dict, nrows: int | None = None) -> pa.Table:
    """Build an Arrow table with the schema's exact types; absent columns are NULL."""
    sch = arrow_schema(table)
    unknown = set(columns) - set(sch.names)
    if unknown:
        raise ValueError(f"{table}: unknown columns {sorted(unknown)}")
    if nrows is None:
        nrows = len(next(iter(columns.values()))) if columns else 0
    arrays = []
    for field in sch:
        v = columns.get(field.name)
        if v is None:
            arrays.append(pa.nulls(nrows, field.type))
        elif np.isscalar(v) or isinstance(v, str):
            arrays.append(pa.array([v] * nrows, type=field.type))
        elif isinstance(v, pa.DictionaryArray):
            arrays.append(v if v.type == field.type else v.cast(field.type))
        elif pa.types.is_dictionary(field.type):
            arrays.append(pa.array(v, type=pa.string(), from_pandas=True).dictionary_encode()
                          .cast(field.type))
        else:
            arrays.append(pa.array(v, type=field.type, from_pandas=True))
    return pa.Table.from_arrays(arrays, schema=sch)


def dict_column(codes: np.ndarray, names: list[str | None] | dict[int, str]) -> pa.DictionaryArray:
    """A string column from integer codes without building one Python string per row.

    `names` maps code -> string (a list indexes by position); codes with no
    name (absent, None, or out of range) become NULL. The dictionary holds
    only real strings: Parquet refuses a dictionary with nulls in it.
    """
    if isinstance(names, dict):
        size = max(names, default=-1) + 1
        table = [names.get(i) for i in range(size)]
    else:
        table = list(names)
    words = [w for w in table if w is not None]
    # code -> position in `words`, -1 for no name; one extra slot for out-of-range codes
    remap = np.full(len(table) + 1, -1, dtype=np.int32)
    pos = 0
    for i, w in enumerate(table):
        if w is not None:
            remap[i] = pos
            pos += 1
    codes = np.asarray(codes).astype(np.int64)
    idx = remap[np.where((codes >= 0) & (codes < len(table)), codes, len(table))]
    mask = idx < 0
    arr = pa.array(np.maximum(idx, 0), type=pa.int32(), mask=mask if mask.any() else None)
    return pa.DictionaryArray.from_arrays(arr, pa.array(words, type=pa.string()))


def _write_parquet(tbl: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    ints = [c for c in tbl.column_names if pa.types.is_integer(tbl.schema.field(c).type)]
    enc = {c: "DELTA_BINARY_PACKED" for c in ints if c in _DELTA_COLUMNS}
    pq.write_table(
        tbl, tmp,
        compression="zstd", compression_level=3,  # 6 costs ~30% more time for <2% size
        use_dictionary=[c for c in tbl.column_names if c not in enc],
        column_encoding=enc or None,
        data_page_version="2.0",
        row_group_size=1 << 20,
        write_statistics=True,
    )
    os.replace(tmp, path)


class SegmentWriter:
    """Buffers event columns in memory and rolls them into Parquet segments.

    One writer per (segment dir, node, session). Not thread-safe: the agent's
    drain loop is the only caller. Rolls (``maybe_roll``) hand the Parquet
    encoding to one background thread (pyarrow releases the GIL while it
    compresses), so the drain loop keeps emptying the ring buffers meanwhile;
    ``flush()`` and ``close()`` wait until everything is on disk. A failed
    write is raised by the next call.
    """

    def __init__(self, seg_dir: Path, node: str, session_id: str, roll_seconds: float = 2.0):
        self.seg_dir = Path(seg_dir)
        self.node = node
        self.session_id = session_id
        self.roll_seconds = roll_seconds
        self.counts: dict[str, int] = {t: 0 for t in schema.EVENT_TABLES}
        self.segments_written = 0
        self._prefix = f"{_safe(node)}__{_safe(session_id)}"
        self._buffers: dict[str, list[pa.Table]] = {t: [] for t in schema.EVENT_TABLES}
        self._state: dict[str, pa.Table] = {}
        self._last_roll = time.monotonic()
        self._jobs: queue.Queue = queue.Queue(maxsize=4)   # bounded: backpressure, not memory
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        try:
            for t in schema.TABLES:
                (self.seg_dir / t).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise IngeroError(f"cannot create segment directory {self.seg_dir}: {e.strerror}; "
                              "choose a writable --out/--segments path") from e
        self._seq, self._next_id = self._resume()

    def _resume(self) -> tuple[int, int]:
        """Continue numbering after segments an earlier run of this writer left."""
        seq, top = 0, -1
        for t in schema.EVENT_TABLES:
            for f in (self.seg_dir / t).glob(f"{self._prefix}__*.parquet"):
                seq = max(seq, int(f.stem.rsplit("__", 1)[1]) + 1)
                md = pq.ParquetFile(f).metadata
                col = md.schema.names.index("event_id")
                for rg in range(md.num_row_groups):
                    st = md.row_group(rg).column(col).statistics
                    if st is not None and st.has_min_max:
                        top = max(top, int(st.max) & ((1 << 48) - 1))
        return seq, schema.node_prefix(self.node) | (top + 1)

    def append(self, table: str, columns: dict) -> None:
        """Buffer rows for an event table. Column names as in ``schema``."""
        if table not in self._buffers:
            raise ValueError(f"{table} is not an event table")
        cols = dict(columns)
        n = len(next(iter(cols.values()))) if cols else 0
        if n == 0:
            return
        if "event_id" not in cols:
            cols["event_id"] = np.arange(self._next_id, self._next_id + n, dtype=np.uint64)
            self._next_id += n
        cols.setdefault("node", self.node)
        cols.setdefault("session_id", self.session_id)
        self._buffers[table].append(to_arrow(table, cols, n))
        self.counts[table] += n

    def put_rows(self, table: str, rows: list[dict]) -> None:
        """Replace this node's and session's rows of a small state table."""
        if table in self._buffers or table not in schema.TABLES:
            raise ValueError(f"{table} is not a state table")
        names = schema.TABLES[table].column_names
        cols = {c: [r.get(c) for r in rows] for c in names}
        for r in rows:
            r_unknown = set(r) - set(names)
            if r_unknown:
                raise ValueError(f"{table}: unknown columns {sorted(r_unknown)}")
        if "node" in cols:
            cols["node"] = [v if v is not None else self.node for v in cols["node"]]
        if "session_id" in cols:
            cols["session_id"] = [v if v is not None else self.session_id for v in cols["session_id"]]
        self._state[table] = to_arrow(table, cols, len(rows))

    def maybe_roll(self) -> bool:
        if time.monotonic() - self._last_roll < self.roll_seconds:
            return False
        self.flush(wait=False)
        return True

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    _write_parquet(*job)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e
            finally:
                self._jobs.task_done()

    def _submit(self, tbl: pa.Table, path: Path) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="segment-writer", daemon=True)
            self._thread.start()
        self._jobs.put((tbl, path))

    def _raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise IngeroError(f"cannot write segments to {self.seg_dir}: {e}") from e

    def flush(self, wait: bool = True) -> None:
        """Write every buffered event table as a new segment, and the state tables."""
        self._raise_error()
        for table, parts in self._buffers.items():
            if not parts:
                continue
            tbl = pa.concat_tables(parts)
            # Rows stay in drain order (about time order). Sorting by process
            # first saves ~1.5 B/event but costs ~0.2 s per million rows, a
            # third of the agent's whole per-event budget (bench/ingest.py).
            self._submit(tbl, self.seg_dir / table / f"{self._prefix}__{self._seq:06d}.parquet")
            self.segments_written += 1
            parts.clear()
        self._seq += 1
        for table, tbl in self._state.items():
            self._submit(tbl, self.seg_dir / table / f"{self._prefix}.parquet")
        self._state.clear()
        self._last_roll = time.monotonic()
        if wait:
            self._jobs.join()
            self._raise_error()

    def close(self) -> None:
        try:
            self.flush(wait=True)
        finally:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread.join()
                self._thread = None


def segment_session(f: Path) -> str | None:
    """The session id in a segment file name: ``<node>__<session>__<n>.parquet`` (events) or
    ``<node>__<session>.parquet`` (state tables). Node names hold no underscores."""
    parts = Path(f).stem.split("__")
    if len(parts) < 2:
        return None
    if len(parts) > 2 and parts[-1].isdigit():
        parts = parts[:-1]
    return "__".join(parts[1:])


def segment_files(sources: list[Path], table: str, session: str | None = None) -> list[Path]:
    """Every segment file of `table` below the given dirs, each distinct file once (of one
    `session` only, when given).

    The same segment copied into two places (same name, same size) counts once.
    """
    seen: dict[tuple[str, int], Path] = {}
    for src in sources:
        src = Path(src)
        for f in sorted(src.rglob(f"{table}/*.parquet")):
            if f.name.startswith(".") or (session is not None and segment_session(f) != session):
                continue
            seen.setdefault((f.name, f.stat().st_size), f)
    return list(seen.values())


def sessions_in(sources: list[Path]) -> list[str]:
    """The session ids of every segment file below the given dirs."""
    return sorted({segment_session(f) or "?" for t in schema.TABLES for f in segment_files(sources, t)})


def sql_list(paths) -> str:
    """A SQL list literal of file names (for read_parquet)."""
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def _damaged(files: list[Path]) -> str | None:
    """The first file that is not a readable Parquet file, with why."""
    import pyarrow.parquet as pq

    for f in files:
        try:
            pq.read_metadata(f)
        except Exception as e:  # pyarrow raises several kinds for a damaged footer
            return f"{f} ({str(e).splitlines()[0][:120]})"
    return None


def attach_segments(con, sources: list[Path], materialize: bool = False,
                    session: str | None = None) -> dict[str, int]:
    """Expose segment dirs as the schema's tables (views, or tables if materialize).

    Tables with no segment file exist empty, so every published query runs. A damaged
    (e.g. truncated) segment file is an IngeroError naming it.
    Returns the number of files found per table.
    """
    import duckdb

    found = {}
    for name, t in schema.TABLES.items():
        files = segment_files(sources, name, session)
        found[name] = len(files)
        kind = "TABLE" if materialize else "VIEW"
        if not files:
            con.execute(t.ddl(if_not_exists=False))
            continue
        cols = ", ".join(f'"{c}"::{ty} AS "{c}"' for c, ty in t.columns)
        try:
            con.execute(
                f"CREATE {kind} {name} AS SELECT {cols} FROM read_parquet({sql_list(files)}, "
                "union_by_name = true)"
            )
        except duckdb.Error as e:
            bad = _damaged(files)
            if bad:
                raise IngeroError(f"segment {bad} is damaged (truncated?): move it out of the folder "
                                  "to read the rest") from None
            raise IngeroError(f"cannot read the {name} segments: {str(e).splitlines()[0]}") from None
    return found


def add_missing_tables(con) -> list[str]:
    """Empty temporary tables for the schema's tables a trace lacks (a DuckDB file written by
    something else, or an older version), so every query and the report run; returns them.
    A table that is there but lacks columns of the schema is an IngeroError naming them."""
    cols: dict[str, set] = {}
    for t, c in con.execute("SELECT table_name, column_name FROM information_schema.columns").fetchall():
        cols.setdefault(t, set()).add(c)
    for name, t in schema.TABLES.items():
        lacking = [c for c, _ in t.columns if name in cols and c not in cols[name]]
        if lacking:
            raise IngeroError(f"table {name} lacks the columns {', '.join(lacking[:6])}"
                              f"{', …' if len(lacking) > 6 else ''}: not an Ingero trace of this version "
                              "(rebuild it from its segments with `ingero merge`)")
    missing = [n for n in schema.TABLES if n not in cols]
    for n in missing:
        con.execute(schema.TABLES[n].ddl(if_not_exists=False).replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
    return missing


def build_duckdb(sources: list[Path], out: Path) -> Path:
    """Build one DuckDB file holding every table of the given segment dirs."""
    import duckdb

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        con = duckdb.connect(str(tmp))
        try:
            attach_segments(con, [Path(s) for s in sources], materialize=True)
            resolve_split_ranks(con)
        finally:
            con.close()
        os.replace(tmp, out)
    except duckdb.Error as e:
        tmp.unlink(missing_ok=True)
        raise IngeroError(f"cannot build {out}: {str(e).splitlines()[0]}") from e
    return out


def separate_recordings(con, schema_name: str = "") -> bool:
    """Whether the sessions of a trace are separate recordings that must not be read together:
    a node or a rank recorded under two of them (two runs traced on one machine, one job traced
    twice). Sessions of disjoint nodes and ranks are one job traced node by node (an `ingero
    trace` per node, the lab's tracers) and are read as one. `schema_name`: where the tables
    are (merge's staging schema)."""
    p = f"{schema_name}." if schema_name else ""
    for tables in (("sessions", "nodes", "ranks"), schema.EVENT_TABLES):
        pairs = " UNION ".join(f"SELECT DISTINCT session_id, node FROM {p}{t} WHERE session_id IS NOT NULL"
                               for t in tables)
        if con.execute(f"SELECT count(*) FROM ({pairs})").fetchone()[0]:
            break
    if con.execute(f"SELECT count(*) FROM ({pairs}) GROUP BY node HAVING count(DISTINCT session_id) > 1 "
                   "LIMIT 1").fetchall():
        return True
    return bool(con.execute(f"SELECT rank FROM {p}ranks WHERE rank IS NOT NULL AND session_id IS NOT NULL "
                            "GROUP BY rank HAVING count(DISTINCT session_id) > 1 LIMIT 1").fetchall())


def file_sessions(con) -> list[str]:
    """The session ids of an opened trace file: from its state tables, or (when those are
    empty) its event tables; [] when it does not say (or a table cannot be read: querying
    it says why)."""
    import duckdb

    for tables in (("sessions", "nodes", "ranks"), schema.EVENT_TABLES):
        try:
            got = con.execute(" UNION ".join(f"SELECT DISTINCT session_id FROM {t} WHERE session_id IS NOT NULL"
                                             for t in tables)).fetchall()
        except duckdb.Error:
            return []
        if got:
            return sorted(str(s) for (s,) in got)
    return []
