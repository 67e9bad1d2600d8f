"""Segments on the operator's disk: fetch what is new, ingest it, merge the artifact.

Per session (``<artifacts>/<namespace>/<name>/``)::

    work/<node>/<table>/*.parquet   copies of each node's segments (mtime = the agent's)
    work/live.duckdb                event rows ingested so far (each segment once) for the live status
    trace.duckdb, report.json       the artifact, written when the session completes

Clock offsets are applied on the way in: a node's ``timestamp_ns`` columns
are shifted by ``-offset`` so that every node's events share the operator's
clock. The live database uses the offset measured when tracing started; the
artifact is rebuilt from all segments with the offsets measured at the end.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import duckdb

from ingero import schema
from ingero.comms import resolve_split_ranks
from ingero.analysis import Report, analyse
from ingero.store import segment_files
from ingero_operator.agents import AgentClient, AgentUnreachable

SHIFTED = {"nccl_events": ("timestamp_ns",), "tcp_events": ("timestamp_ns",),
           "sched_events": ("timestamp_ns",), "comms": ("timestamp_ns",)}
LIST_OVERLAP_NS = 2_000_000_000   # file mtimes tick coarsely: re-list this far back, skip known files


class LocalSession:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.work = self.root / "work"
        self.live_db = self.work / "live.duckdb"
        self.artifact = self.root / "trace.duckdb"
        self.report = self.root / "report.json"

    def node_dir(self, node: str) -> Path:
        return self.work / "nodes" / node

    def nodes(self) -> list[str]:
        d = self.work / "nodes"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def needs(self, node: str, entry: dict) -> bool:
        try:
            st = (self.node_dir(node) / entry["table"] / entry["name"]).stat()
        except FileNotFoundError:
            return True
        return st.st_size != entry["size"] or st.st_mtime_ns < entry["mtime_ns"]


async def fetch_new(client: AgentClient, sid: str, local: LocalSession, since_ns: int,
                    sem: asyncio.Semaphore) -> tuple[int, int]:
    """Download the node's segments that are new or changed. Returns (new cursor, files fetched)."""
    listing = await client.segments(sid, max(0, since_ns - LIST_OVERLAP_NS))
    if listing is None:
        return since_ns, 0
    todo = [e for e in listing["segments"] if e["table"] in schema.TABLES and local.needs(client.node, e)]

    async def one(e):
        async with sem:
            dest = local.node_dir(client.node) / e["table"] / e["name"]
            await client.download(sid, e["table"], e["name"], dest, int(e["mtime_ns"]))

    results = await asyncio.gather(*(one(e) for e in todo), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0] if isinstance(errors[0], AgentUnreachable) else AgentUnreachable(
            f"{client}: {errors[0]}")
    return int(listing.get("cursor") or since_ns), len(todo)


def _select(table: str, files: list[Path], offset_ns: int) -> tuple[str, list]:
    paths = [str(f) for f in files]
    shift = SHIFTED.get(table, ())
    repl = ", ".join(f'"{c}" - ?::BIGINT AS "{c}"' for c in shift)
    star = f"* REPLACE ({repl})" if repl else "*"
    return (f"SELECT {star} FROM read_parquet(?, union_by_name = true)",
            [offset_ns] * len(shift) + [paths])


def _insert(con, table: str, files: list[Path], offset_ns: int) -> None:
    if not files:
        return
    sql, params = _select(table, files, offset_ns)
    con.execute(f"INSERT INTO {table} BY NAME {sql}", params)


def _load_state(con, local: LocalSession, offsets: dict[str, int]) -> None:
    """Small state tables are replaced as a whole (agents rewrite them in place)."""
    for table in schema.TABLES:
        if table in schema.EVENT_TABLES:
            continue
        con.execute(f"DELETE FROM {table}")
        for node in local.nodes():
            _insert(con, table, segment_files([local.node_dir(node)], table), offsets.get(node, 0))
    for node, off in offsets.items():
        con.execute("UPDATE nodes SET clock_offset_ns = ? WHERE node = ?", [off, node])


def world_size(con) -> int | None:
    row = con.execute("SELECT max(world_size), count(DISTINCT rank) FROM ranks").fetchone()
    return int(row[0] or row[1] or 0) or None


def ingest_and_analyse(local: LocalSession, offsets: dict[str, int],
                       slow_collective_ms: float | None = None) -> tuple[Report, int | None]:
    """Add event segments not yet in the live database, refresh state tables, analyse."""
    local.work.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(local.live_db))
    try:
        schema.create_all(con)
        con.execute("CREATE TABLE IF NOT EXISTS _ingested (node VARCHAR, tbl VARCHAR, name VARCHAR)")
        seen = set(con.execute("SELECT node, tbl, name FROM _ingested").fetchall())
        for node in local.nodes():
            for table in schema.EVENT_TABLES:
                new = [f for f in segment_files([local.node_dir(node)], table)
                       if (node, table, f.name) not in seen]
                if not new:
                    continue
                _insert(con, table, new, offsets.get(node, 0))
                con.executemany("INSERT INTO _ingested VALUES (?, ?, ?)", [[node, table, f.name] for f in new])
        _load_state(con, local, offsets)
        resolve_split_ranks(con)
        return analyse(con, slow_collective_ms), world_size(con)
    finally:
        con.close()


def build_artifact(local: LocalSession, offsets: dict[str, int],
                   slow_collective_ms: float | None = None) -> tuple[Report, int | None]:
    """Merge every node's segments (clock offsets applied) into trace.duckdb and analyse it."""
    tmp = local.artifact.with_name(f".{local.artifact.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    con = duckdb.connect(str(tmp))
    try:
        schema.create_all(con)
        for node in local.nodes():
            for table in schema.EVENT_TABLES:
                _insert(con, table, segment_files([local.node_dir(node)], table), offsets.get(node, 0))
        _load_state(con, local, offsets)
        resolve_split_ranks(con)
        result = analyse(con, slow_collective_ms), world_size(con)
    finally:
        con.close()
    os.replace(tmp, local.artifact)
    return result
