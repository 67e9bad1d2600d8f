"""Offline merge: DuckDB files and segment folders copied from nodes into one queryable trace.

For air-gapped clusters, where nobody can reach the agents: copy each node's
segments (or ``ingero trace`` outputs, or operator artifacts) and merge.

* Every input is checked on its own: a truncated or foreign file is named
  and skipped, and nothing else is lost (one Parquet file or one DuckDB file
  at a time, each loaded in its own transaction into a staging database).
* Repeated rows count once: event rows are keyed by (node, session_id,
  event_id) (event ids are node-namespaced and a node numbers each session
  from 0), state tables by their natural keys (``KEYS``), preferring the most
  complete copy (a resolved split rank, the latest totals).
* Clock offsets: in every Ingero trace ``nodes.clock_offset_ns`` says by how
  much that node's ``timestamp_ns`` were already shifted (NULL: not at all,
  as in raw segments). Rows are brought back to the node's own clock, then
  each node's known offset (from any input that knows it, or
  ``--clock-offset``) is applied once, as the operator's gather does. So
  merging the merge with one of its inputs again changes nothing.
* Split communicators' ranks are resolved once every node is in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from ingero import schema
from ingero.comms import resolve_split_ranks
from ingero.errors import IngeroError
from ingero.families import EVENT_KEY, RINGS
from ingero.store import separate_recordings

# table -> (key columns, preference among copies of one key: the first row wins)
KEYS = {
    **{r.table: (EVENT_KEY, r.prefer) for r in RINGS.values()},
    "nccl_proxy": (EVENT_KEY, "rank DESC NULLS LAST"),
    "rdma_counters": (EVENT_KEY, "timestamp_ns"),
    "rdma_ports": (("node", "session_id", "device", "port"), "state NULLS LAST"),
    "rdma_ranks": (("node", "session_id", "pid", "device", "port"), "rank DESC NULLS LAST"),
    "comms": (("node", "session_id", "pid", "comm", "comm_id_hash", "op"), "rank DESC NULLS LAST"),
    "ranks": (("node", "session_id", "pid"), "first_seen_ns NULLS LAST"),
    "sched_totals": (("node", "session_id", "pid", "reason"), "total_ns DESC NULLS LAST"),
    "nccl_inflight": (("node", "session_id", "pid", "tid"), "seen_ns DESC NULLS LAST"),
    "nccl_device_inflight": (("node", "session_id", "pid", "comm_hash", "slot"), "seen_ns DESC NULLS LAST"),
    "nodes": (("node", "session_id"), "ended_ns DESC NULLS LAST, "
              + " + ".join(f"coalesce(events_{r}, 0)" for r in RINGS) + " DESC"),
    "sessions": (("node", "session_id"), "ended_ns DESC NULLS LAST"),
}


@dataclass
class MergeResult:
    out: Path
    rows: dict[str, int] = field(default_factory=dict)       # table -> rows in the output
    loaded: list[str] = field(default_factory=list)          # inputs (files) that were used
    skipped: list[str] = field(default_factory=list)         # "path: why"
    offsets: dict[str, int | None] = field(default_factory=dict)  # node -> offset applied (None: unknown)
    warnings: list[str] = field(default_factory=list)


def _qi(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _select(table: str, have: set[str], shift_by: str | None = None) -> str:
    """Columns of `table` as the schema types them, NULL where the input lacks one;
    the table's clock column plus `shift_by` (an SQL expression) when given."""
    out = []
    for c, ty in schema.TABLES[table].columns:
        expr = f"t.{_qi(c)}::{ty}" if c in have else f"NULL::{ty}"
        if shift_by and c in schema.CLOCK_COLUMNS.get(table, ()) and c in have:
            expr = f"({expr} + {shift_by})"
        out.append(f"{expr} AS {_qi(c)}")
    return ", ".join(out)


class Merger:
    def __init__(self, out: Path, offsets: dict[str, int] | None = None):
        self.out = Path(out)
        self.cli_offsets = dict(offsets or {})
        self.tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")
        self.stage_path = self.out.with_name(f".{self.out.name}.stage-{os.getpid()}")
        self.result = MergeResult(self.out)
        self.known: dict[tuple, int] = {}     # (node, session_id) -> offset, from DuckDB inputs
        self.src = 0

    # ---- staging ---------------------------------------------------------------------
    def _open(self):
        for p in (self.tmp, self.stage_path):
            p.unlink(missing_ok=True)
        self.con = duckdb.connect(str(self.tmp))
        self.con.execute("ATTACH ? AS stage", [str(self.stage_path)])
        for name, t in schema.TABLES.items():
            cols = ", ".join(f"{_qi(c)} {ty}" for c, ty in t.columns)
            self.con.execute(f"CREATE TABLE stage.{name} ({cols}, _src INTEGER)")

    def _skip(self, path: Path, why: str) -> None:
        self.result.skipped.append(f"{path}: {why}")

    def add_parquet(self, path: Path, table: str) -> int:
        """One segment file (raw node clock). Returns rows staged (0 when skipped)."""
        try:
            have = set(pq.read_schema(path).names)
        except Exception as e:  # truncated, not Parquet, unreadable
            self._skip(path, f"not a readable Parquet file ({type(e).__name__}: {str(e)[:120]})")
            return 0
        keys = KEYS[table][0]
        if not set(keys) <= have:
            self._skip(path, f"not an Ingero {table} segment (no {', '.join(sorted(set(keys) - have))} column)")
            return 0
        self.src += 1
        sql = (f"INSERT INTO stage.{table} SELECT {_select(table, have)}, {self.src} "
               "FROM read_parquet(?) t")
        try:
            self.con.execute("BEGIN")
            n = self.con.execute(sql, [str(path)]).fetchone()[0]
            self.con.execute("COMMIT")
        except duckdb.Error as e:
            self.con.execute("ROLLBACK")
            self._skip(path, f"unreadable ({str(e).splitlines()[0][:160]})")
            return 0
        self.result.loaded.append(str(path))
        return n

    def add_duckdb(self, path: Path) -> int:
        """A trace .duckdb (lab trace, operator artifact, earlier merge); timestamps made raw.

        It is read through the sandbox of ``readonly_sql`` (file access limited to the trace's
        own files: a crafted view cannot read anything else) and streamed into the stage."""
        from ingero.readonly_sql import open_sandbox

        try:
            src = open_sandbox(path)
        except (IngeroError, duckdb.Error) as e:
            self._skip(path, f"not a readable DuckDB file ({str(e).splitlines()[0][:160]})")
            return 0
        try:
            # tables, and views (the operator's artifact keeps nccl_events as a view over its segments),
            # by unqualified name: a view naming its files relatively is shadowed (confine_views)
            tables: dict[str, set[str]] = {}
            for t, c in src.execute("SELECT table_name, column_name FROM duckdb_columns() "
                                    "WHERE database_name = 'trace' AND NOT internal").fetchall():
                tables.setdefault(t, set()).add(c)
            usable = {t: cols for t, cols in tables.items()
                      if t in schema.TABLES and set(KEYS[t][0]) <= cols}
            if not any(t in usable for t in schema.EVENT_TABLES):
                self._skip(path, "not an Ingero trace (no nccl_events/tcp_events/sched_events table "
                                 "with node, session_id and event_id)")
                return 0
            self.src += 1
            has_offsets = "nodes" in usable and "clock_offset_ns" in usable["nodes"]
            applied = {}
            if has_offsets:
                for node, sid, off in src.execute(
                        "SELECT node, session_id, any_value(clock_offset_ns) FROM nodes "
                        "WHERE clock_offset_ns IS NOT NULL GROUP BY ALL").fetchall():
                    applied[(node, sid)] = int(off)
            total, ok = 0, 0
            for table, have in usable.items():
                if applied and table in schema.CLOCK_COLUMNS:
                    sel = _select(table, have, "coalesce(o.off, 0)")
                    sql = (f"SELECT {sel}, {self.src} FROM {table} t "
                           "LEFT JOIN (SELECT node AS o_node, session_id AS o_sid, any_value(clock_offset_ns) AS off "
                           "FROM nodes GROUP BY ALL) o ON o.o_node IS NOT DISTINCT FROM t.node "
                           "AND o.o_sid IS NOT DISTINCT FROM t.session_id")
                else:
                    sql = f"SELECT {_select(table, have)}, {self.src} FROM {table} t"
                try:   # table by table: one unreadable table (a view whose files are gone) loses only itself
                    rel = src.sql(sql)
                    # a stream of Arrow batches (DuckDB 2: to_arrow_reader; 1.x: record_batch)
                    rows = rel.to_arrow_reader() if hasattr(rel, "to_arrow_reader") else rel.record_batch()
                    self.con.register("_src_rows", rows)
                    self.con.execute("BEGIN")
                    total += self.con.execute(f"INSERT INTO stage.{table} SELECT * FROM _src_rows").fetchone()[0]
                    self.con.execute("COMMIT")
                    ok += 1
                except duckdb.Error as e:
                    try:
                        self.con.execute("ROLLBACK")
                    except duckdb.Error:
                        pass      # the error came before BEGIN
                    self._skip(path, f"table {table} unreadable ({str(e).splitlines()[0][:160]})")
                finally:
                    try:
                        self.con.unregister("_src_rows")
                    except duckdb.Error:
                        pass
        except duckdb.Error as e:
            self._skip(path, f"unreadable DuckDB trace ({str(e).splitlines()[0][:160]})")
            return 0
        finally:
            src.close()
        if not ok:
            return 0
        for key, off in applied.items():
            if key in self.known and self.known[key] != off:
                self.result.warnings.append(f"node {key[0]} session {key[1]}: inputs disagree on its clock "
                                            f"offset ({self.known[key]} vs {off} ns); kept the first")
            self.known.setdefault(key, off)
        self.result.loaded.append(str(path))
        return total

    # ---- output ----------------------------------------------------------------------
    def _offsets_table(self) -> None:
        self.con.execute("CREATE TEMP TABLE _off (node VARCHAR, session_id VARCHAR, off BIGINT)")
        rows = dict(self.known)
        pairs = self.con.execute(" UNION ".join(f"SELECT DISTINCT node, session_id FROM stage.{t}"
                                                for t in schema.TABLES)).fetchall()
        for node, sid in pairs:
            if node in self.cli_offsets:
                rows[(node, sid)] = self.cli_offsets[node]
        if rows:
            self.con.executemany("INSERT INTO _off VALUES (?, ?, ?)", [[n, s, o] for (n, s), o in rows.items()])
        for (node, _), off in sorted(rows.items(), key=lambda kv: str(kv[0])):
            self.result.offsets[node] = off
        for node, _ in pairs:
            self.result.offsets.setdefault(node, None)

    def keep_session(self, session: str | None) -> None:
        """Keep the staged rows of one session: `session`, or every one when they are one job
        traced node by node (store.separate_recordings); separate recordings without
        `session`, or a `session` not there, is an IngeroError listing them."""
        have = sorted({str(s) for (s,) in self.con.execute(" UNION ".join(
            f"SELECT DISTINCT session_id FROM stage.{t}" for t in schema.TABLES)).fetchall()})
        listed = ", ".join(have[:10]) + (", …" if len(have) > 10 else "")
        if session is not None and session not in have:
            raise IngeroError(f"the inputs hold no session {session!r}; they hold {listed}")
        if session is None and len(have) > 1 and separate_recordings(self.con, "stage"):
            raise IngeroError(f"the inputs hold {len(have)} sessions ({listed}) that recorded one node or "
                              "rank twice: pick one with --session")
        if session is not None:
            for t in schema.TABLES:
                self.con.execute(f"DELETE FROM stage.{t} WHERE session_id IS DISTINCT FROM ?", [session])

    def finish(self) -> MergeResult:
        self._offsets_table()
        schema.create_all(self.con)
        for table, (keys, pref) in KEYS.items():
            cols = schema.TABLES[table].column_names
            shift = schema.CLOCK_COLUMNS.get(table, ())
            sel = ", ".join(f"s.{_qi(c)} - coalesce(o.off, 0)" if c in shift else f"s.{_qi(c)}" for c in cols)
            part = ", ".join(f"s.{_qi(k)}" for k in keys)
            self.con.execute(f"""
                INSERT INTO {table} SELECT {sel} FROM stage.{table} s
                LEFT JOIN _off o ON o.node IS NOT DISTINCT FROM s.node
                                AND o.session_id IS NOT DISTINCT FROM s.session_id
                QUALIFY row_number() OVER (PARTITION BY {part} ORDER BY {pref}, s._src) = 1
                ORDER BY {part}""")
        self.con.execute("UPDATE nodes SET clock_offset_ns = o.off FROM _off o "
                         "WHERE nodes.node IS NOT DISTINCT FROM o.node "
                         "AND nodes.session_id IS NOT DISTINCT FROM o.session_id")
        self.con.execute("UPDATE nodes SET clock_offset_ns = NULL WHERE NOT EXISTS (SELECT 1 FROM _off o "
                         "WHERE o.node IS NOT DISTINCT FROM nodes.node "
                         "AND o.session_id IS NOT DISTINCT FROM nodes.session_id)")
        resolve_split_ranks(self.con)
        self.con.execute("DETACH stage")
        for t in schema.TABLES:
            self.result.rows[t] = self.con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        self.con.close()
        self.stage_path.unlink(missing_ok=True)
        os.replace(self.tmp, self.out)
        return self.result

    def abort(self) -> None:
        try:
            self.con.close()
        except Exception:
            pass
        for p in (self.tmp, self.stage_path, self.stage_path.with_name(self.stage_path.name + ".wal"),
                  self.tmp.with_name(self.tmp.name + ".wal")):
            p.unlink(missing_ok=True)


def _segment_inputs(d: Path) -> list[tuple[Path, str | None]]:
    """(file, table) for every segment below a folder, each distinct file once (name and size)."""
    seen: dict[tuple, tuple[Path, str]] = {}
    for f in sorted(d.rglob("*.parquet")):
        if f.name.startswith(".") or f.parent.name not in schema.TABLES:
            continue
        try:
            size = f.stat().st_size
        except OSError:
            continue
        seen.setdefault((f.parent.name, f.name, size), (f, f.parent.name))
    return list(seen.values())


def merge(inputs: list[Path], out: Path, offsets: dict[str, int] | None = None,
          session: str | None = None) -> MergeResult:
    """Merge `inputs` (DuckDB files, segment folders, segment files) into `out`: the rows
    of `session`, or of every session when they are one job traced node by node.

    IngeroError when nothing usable was found, or when the inputs hold separate recordings
    (store.separate_recordings) and `session` names none of them (the output is then not written).
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise IngeroError(f"-o {out}: folder {out.parent} does not exist; create it or pick another path")
    m = Merger(out, offsets)
    m._open()
    try:
        files: list[tuple[Path, str | None]] = []
        for raw in inputs:
            p = Path(raw)
            if p.is_dir():
                found = _segment_inputs(p)
                if (p / "trace.duckdb").is_file():
                    # the operator's artifact folder (or a lab --out folder): its trace.duckdb
                    # knows the clock offsets and resolved ranks of the segments beside it
                    found = [(p / "trace.duckdb", None)] + found
                if not found:
                    m._skip(p, "folder holds no Ingero segments (<table>/<node>__<session>__<n>.parquet)")
                files += found
            elif p.is_file():
                files.append((p, p.parent.name if p.suffix == ".parquet" and p.parent.name in schema.TABLES
                              else None))
            else:
                m._skip(p, "does not exist")
        # DuckDB inputs first: what they know (resolved ranks, offsets) wins ties.
        seen_parquet = set()
        for p, table in sorted(files, key=lambda x: x[1] is not None):
            if table is None:
                if p.suffix == ".parquet":
                    m._skip(p, "a Parquet file outside a <table>/ folder: pass its segment folder")
                else:
                    m.add_duckdb(p)
            else:
                key = (table, p.name, p.stat().st_size)
                if key not in seen_parquet:
                    seen_parquet.add(key)
                    m.add_parquet(p, table)
        if not m.result.loaded:
            why = "; ".join(m.result.skipped) or "no input given"
            raise IngeroError(f"nothing usable to merge ({why})")
        m.keep_session(session)
        return m.finish()
    except BaseException:
        m.abort()
        raise
