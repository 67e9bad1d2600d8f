"""Read-only, bounded SQL over a trace: the agent's query endpoint and the MCP server use it.

The guard is the engine, not a string filter. Each query gets a fresh
in-memory DuckDB connection that sees the trace as views (segment
directories) or as an attached database opened ``READ_ONLY`` (a ``.duckdb``
file; the Parquet files its own views read are allowed when they lie in its
folder, as the operator's artifact keeps ``nccl_events``, and only by absolute
path, never relative to the working directory). Then file access is switched
off (``enable_external_access = false``, with ``allowed_directories`` = the
segment folders the views read; the temp directory, which DuckDB allows too, is a
fresh private folder of the connection's own, or none at all), so
``COPY ... TO``, ``ATTACH``, ``read_csv('/etc/passwd')``, ``INSTALL`` and
``LOAD`` all fail) and the configuration is locked, so the query cannot
switch it back. On top of that only one ``SELECT`` (or ``EXPLAIN``)
statement is accepted, and the query is bounded: a timer interrupts it,
memory and threads are capped, spilling to disk is off for served queries, and at most
``max_rows`` rows and about ``max_bytes`` bytes of JSON come back.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import re
import resource
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from ingero import schema
from ingero.errors import IngeroError, duckdb_line
from ingero.store import add_missing_tables, attach_segments, file_sessions, separate_recordings, sessions_in

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
# What a serving process needs beside its queries, in its data memory (VmData): the
# interpreter, DuckDB and pyarrow (~180 MiB) and the stacks of its threads (8 MiB each,
# reserved whole: ~20 threads at most, as no server starts one per connection).
PROCESS_RESERVE_MB = 384


@dataclass
class Limits:
    """Bounds of one query; units in the names."""

    timeout_s: float = 10.0          # interrupted after this long
    max_rows: int = 10_000           # rows returned; more are cut (truncated = "rows")
    max_bytes: int = 4 << 20         # JSON size of the rows returned (truncated = "bytes")
    memory_mb: int = 512             # DuckDB memory_limit of the query's connection, MiB
    threads: int = 2                 # DuckDB threads of the query's connection
    # the settings that bound a query's memory, as the error names them to whoever runs it
    memory_flags: str = "the query memory limit"

    def narrowed(self, timeout_s=None, max_rows=None) -> "Limits":
        """These limits, tightened (never widened) by a caller's request; ValueError for a
        value that is not a finite number (1e400 parses as infinity)."""
        out = Limits(**self.__dict__)
        for v in (timeout_s, max_rows):
            try:
                finite = v is None or (not isinstance(v, bool) and math.isfinite(float(v)))
            except OverflowError:            # an integer of thousands of digits
                finite = False
            if not finite:
                raise ValueError("not a finite number")
        if timeout_s is not None:
            out.timeout_s = min(self.timeout_s, max(0.05, float(timeout_s)))
        if max_rows is not None:
            out.max_rows = min(self.max_rows, max(0, int(max_rows)))
        return out


@dataclass
class Result:
    columns: list[str]
    types: list[str]
    rows: list[list] = field(default_factory=list)
    truncated: str | None = None     # None, "rows" or "bytes"
    elapsed_ms: float = 0.0

    def to_dict(self) -> dict:
        return {"columns": self.columns, "types": self.types, "rows": self.rows,
                "truncated": self.truncated, "elapsed_ms": round(self.elapsed_ms, 3)}


class QueryRefused(IngeroError):
    """The statement is not allowed, does not parse, fails, or ran out of time."""

    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


def jsonable(v):
    """A DuckDB value as plain JSON (big integers stay integers)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return str(v)


_QUOTED_PARQUET = re.compile(r"'((?:[^']|'')+\.parquet)'")


def confine_views(con, folder: Path) -> list[str]:
    """Point the attached trace's views at Parquet files inside `folder` by absolute path;
    returns those files (the only ones to allow).

    DuckDB looks a relative name up in the working directory before ``file_search_path``,
    and checks the name as spelled, so a relative name is never allowed: each view of the
    trace's main schema naming files relatively is shadowed by a temporary view naming them
    absolutely (the operator's artifact names its segments relative to its folder). A name
    outside `folder`, or a view that cannot be shadowed, stays as it is and is refused."""
    allowed: set[str] = set()
    for (sql,) in con.execute("SELECT sql FROM duckdb_views() WHERE database_name = 'trace' "
                              "AND schema_name = 'main' AND NOT internal").fetchall():
        def absolute(m):
            p = (folder / m.group(1).replace("''", "'")).resolve()
            if not (p.is_relative_to(folder) and p.is_file()):
                return m.group(0)
            allowed.add(str(p))
            return "'" + str(p).replace("'", "''") + "'"

        shadow = _QUOTED_PARQUET.sub(absolute, sql or "")
        if shadow != sql:
            try:
                con.execute(re.sub(r"^\s*CREATE\s+VIEW", "CREATE TEMP VIEW", shadow, count=1, flags=re.I))
            except duckdb.Error:
                pass
    return sorted(allowed)


def open_sandbox(source: Path | list[Path], limits: Limits | None = None, session: str | None = None,
                 memory_mb: int | None = None):
    """A locked, read-only connection over a ``.duckdb`` file or segment directories (of one
    `session`, when given). `limits`: memory and threads of the connection (None: DuckDB's
    defaults, or `memory_mb` of memory, for the local CLI); the other bounds apply per query
    in ``run``."""
    con = duckdb.connect(config={"autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
    try:
        if isinstance(source, (str, Path)) and Path(source).is_file():
            path = Path(source).resolve()
            try:
                con.execute("ATTACH ? AS trace (READ_ONLY)", [str(path)])
            except duckdb.Error as e:
                raise IngeroError(f"{path} is not a trace (DuckDB cannot open it: {duckdb_line(e)}); pass a "
                                  "trace.duckdb (ingero trace --out, ingero lab run --trace, a session's "
                                  "artifact) or a folder of segments") from e
            con.execute("USE trace")
            files = confine_views(con, path.parent)
            if files:   # views over segments kept beside the file (the operator's artifact)
                con.execute("SET allowed_paths = ?", [files])
        else:
            dirs = [Path(d).resolve() for d in ([source] if isinstance(source, (str, Path)) else source)]
            dirs = [d for d in dirs if d.is_dir()]
            if dirs:
                con.execute("SET allowed_directories = ?", [[str(d) + "/" for d in dirs]])
            attach_segments(con, dirs, session=session)
        add_missing_tables(con)
        # DuckDB allows reads of its temp directory (<cwd>/.tmp by default): a served query
        # gets none (no spilling), a local one a fresh private folder holding only its spill
        if limits is not None:
            con.execute(f"SET memory_limit = '{int(limits.memory_mb)}MiB'")
            con.execute(f"SET threads = {int(limits.threads)}")
            con.execute("SET max_temp_directory_size = '0B'")
            con.execute("SET temp_directory = ''")
        else:
            if memory_mb:
                con.execute(f"SET memory_limit = '{int(memory_mb)}MiB'")
            scratch = tempfile.mkdtemp(prefix="ingero-duckdb-")
            weakref.finalize(con, shutil.rmtree, scratch, True)
            con.execute("SET temp_directory = ?", [scratch])
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


def bound_process(max_memory_mb: int, limits: Limits, queries_at_once: int, flags: str) -> None:
    """Bound this process's data memory (soft RLIMIT_DATA) to `max_memory_mb`, after checking
    that `queries_at_once` queries of `limits` fit in it beside PROCESS_RESERVE_MB.

    DuckDB's memory_limit covers its buffers, not every allocation: ``SELECT repeat('x',
    1073741000)`` took a process to 4 GiB under a memory_limit of 256 MiB. Under the bound
    such an allocation fails inside DuckDB (or in Python), the query is refused in one line
    naming `flags`, and the process keeps serving. Child processes must drop it
    (``unbound_process``)."""
    need = queries_at_once * limits.memory_mb + PROCESS_RESERVE_MB
    if need > max_memory_mb:
        raise IngeroError(f"{flags}: {queries_at_once} queries of {limits.memory_mb} MiB and {PROCESS_RESERVE_MB} "
                          f"MiB for the process need {need} MiB, more than its {max_memory_mb} MiB: lower the "
                          "query memory or raise the process's")
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    want = max_memory_mb << 20
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (want, hard))


def unbound_process() -> None:
    """In a child (before exec): none of the bound of ``bound_process``."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


def check_text(sql: str) -> None:
    """SQL text that DuckDB can take, or QueryRefused saying why."""
    if not isinstance(sql, str) or not sql.strip():
        raise QueryRefused("no SQL given: send one SELECT statement")
    try:
        sql.encode("utf-8")
    except UnicodeEncodeError as e:          # a lone surrogate, e.g. JSON's "\ud800"
        raise QueryRefused(f"query is not valid UTF-8 text ({e.reason} at character {e.start}): "
                           "send the SQL as Unicode text") from None


def check_statement(con, sql: str) -> None:
    """Exactly one SELECT/EXPLAIN statement, or QueryRefused naming what was given."""
    check_text(sql)
    try:
        stmts = con.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryRefused(f"query does not parse: {duckdb_line(e)}") from e
    if len(stmts) != 1:
        raise QueryRefused(f"{len(stmts)} statements given: send exactly one SELECT statement")
    if stmts[0].type not in ALLOWED:
        kind = str(stmts[0].type).rsplit(".", 1)[-1]
        raise QueryRefused(f"{kind} statements are not allowed: queries are read-only, send one SELECT")


def run(con, sql: str, limits: Limits | None = None) -> Result:
    """Run one read-only statement within `limits` on a sandbox connection."""
    limits = limits or Limits()
    check_statement(con, sql)
    timer = threading.Timer(limits.timeout_s, con.interrupt)
    t0 = time.monotonic()
    timer.start()
    try:
        cur = con.execute(sql)
        names = [d[0] for d in cur.description or []]
        types = [str(d[1]) for d in cur.description or []]
        res = Result(names, types)
        size = len(json.dumps(names)) + 2
        while True:
            batch = cur.fetchmany(min(1024, limits.max_rows - len(res.rows) + 1))
            if not batch:
                break
            for row in batch:
                if len(res.rows) >= limits.max_rows:
                    res.truncated = "rows"
                    break
                # a value larger than what is left is never turned into JSON (a copy)
                if sum(len(v) for v in row if isinstance(v, (str, bytes))) + size > limits.max_bytes:
                    res.truncated = "bytes"
                    break
                row = [jsonable(v) for v in row]
                size += len(json.dumps(row, separators=(",", ":"))) + 1
                if size > limits.max_bytes:
                    res.truncated = "bytes"
                    break
                res.rows.append(row)
            if res.truncated:
                break
    except duckdb.InterruptException as e:
        raise QueryRefused(f"query interrupted after {limits.timeout_s:g} s: narrow it (WHERE, LIMIT) "
                           "or raise the timeout", timeout=True) from e
    except (duckdb.OutOfMemoryException, MemoryError) as e:
        raise QueryRefused(f"query needs more memory than {limits.memory_flags} allow: narrow it "
                           "(WHERE, LIMIT, smaller values) or raise them") from e
    except duckdb.Error as e:
        raise QueryRefused(f"query failed: {duckdb_line(e)}") from e
    finally:
        timer.cancel()
    res.elapsed_ms = (time.monotonic() - t0) * 1e3
    return res


def query(source: Path | list[Path], sql: str, limits: Limits | None = None) -> Result:
    """Open a sandbox over `source`, run `sql` within `limits`, close it. A trace that cannot
    be opened (a damaged segment) refuses the query too, naming why."""
    check_text(sql)
    try:
        con = open_sandbox(source, limits or Limits())
    except IngeroError as e:
        raise QueryRefused(str(e)) from None
    try:
        return run(con, sql, limits)
    finally:
        con.close()


def open_source(path: Path, session: str | None = None, memory_mb: int | None = None):
    """Open a trace for reading: a DuckDB file, an artifact or lab folder holding
    ``trace.duckdb``, or a directory of segments (of one `session`, when it holds several).

    The connection is the sandbox of ``ingero.readonly_sql``: file access is off beyond the
    trace's own files, so a crafted trace cannot read or write anything else. `memory_mb`:
    DuckDB's memory_limit (None: its default, 80% of the machine's memory)."""
    path = Path(path)
    if path.is_dir() and (path / "trace.duckdb").is_file() and not any(
            any((path / t).glob("*.parquet")) for t in schema.TABLES):
        # an operator artifact folder or a lab --out folder (its nodes/ is no `nodes` table)
        path = path / "trace.duckdb"
    if path.is_dir():
        sessions = sessions_in([path])
        if not sessions:
            raise IngeroError(f"{path} holds no Ingero segments; pass a trace .duckdb file "
                              "or the segment directory `ingero trace` wrote")
        if session is not None and session not in sessions:
            raise IngeroError(f"{path} holds no session {session!r}; it holds {', '.join(sessions)}")
        con = open_sandbox(path, session=session, memory_mb=memory_mb)
        if session is None and len(sessions) > 1 and separate_recordings(con):
            con.close()
            raise IngeroError(f"{path} holds {len(sessions)} sessions ({_listed(sessions)}): pick one with --session")
        return con
    if not path.exists():
        raise IngeroError(f"{path} does not exist; pass a trace .duckdb file or a segment directory")
    con = open_sandbox(path, memory_mb=memory_mb)
    try:
        sessions = file_sessions(con)
        if session is not None and session not in sessions:
            raise IngeroError(f"{path} holds no session {session!r}; it holds {', '.join(sessions) or 'none'}")
        if len(sessions) > 1 and separate_recordings(con):
            raise IngeroError(f"{path} holds {len(sessions)} sessions ({_listed(sessions)}): write one apart "
                              f"with `ingero merge {path} --session ID -o one.duckdb`")
    except BaseException:
        con.close()
        raise
    return con


def _listed(sessions: list[str]) -> str:
    return ", ".join(sessions[:10]) + (", …" if len(sessions) > 10 else "")
