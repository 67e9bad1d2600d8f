"""The operator never writes where an agent's segment listing points: names that are not plain
segment file names are refused and reported (a fake agent once made it write outside the
session folder)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from ingero_operator.gather import LocalSession, fetch_new
from tests.security.test_attack_hostile_agent import agent_at

GOOD = "node-a__s1__0.parquet"
HOSTILE = ["../../escaped.parquet", "/tmp/abs.parquet", "..parquet", "a/../../b.parquet",
           "x.parquet/../../../y.parquet", "evil.sh", ".hidden.parquet"]


async def _fetch(tmp_path: Path, listing: dict, node: str = "node-a"):
    hits: list[str] = []

    async def segments(_req):
        return web.json_response(listing)

    async def segment(req):
        hits.append(req.match_info["tail"])
        return web.Response(body=b"PAR1 not really")

    app = web.Application()
    app.router.add_get("/v1/sessions/s1/segments", segments)
    app.router.add_get("/v1/sessions/s1/segments/{tail:.*}", segment)
    async with agent_at(app, node=node) as client:
        got = await fetch_new(client, "s1", LocalSession(tmp_path / "session"), 0, asyncio.Semaphore(2))
    return got, hits


def _entry(name, table="nccl_events", size=15, mtime_ns=1_700_000_000_000_000_000):
    return {"table": table, "name": name, "size": size, "mtime_ns": mtime_ns}


def test_hostile_segment_names_are_refused_and_reported_and_nothing_lands_outside(tmp_path):
    listing = {"segments": [_entry(GOOD)] + [_entry(n) for n in HOSTILE], "cursor": 5}
    (cursor, fetched, refused), hits = asyncio.run(_fetch(tmp_path, listing))
    assert fetched == 1 and hits == [f"nccl_events/{GOOD}"] and cursor == 5
    assert len(refused) == len(HOSTILE) and all(w.startswith("node node-a: refused") for w in refused)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["session/work/announced.tsv", f"session/work/nodes/node-a/nccl_events/{GOOD}"], files
    assert (tmp_path / "session/work/announced.tsv").read_text() == f"node-a\tnccl_events\t{GOOD}\n"


def test_unknown_tables_and_non_numeric_sizes_are_refused(tmp_path):
    listing = {"segments": [_entry(GOOD, table="../etc"), _entry(GOOD, size="9"),
                            _entry(GOOD, mtime_ns=-1), "not-an-object"]}
    (_, fetched, refused), hits = asyncio.run(_fetch(tmp_path, listing))
    assert fetched == 0 and hits == [] and len(refused) == 4


def test_a_node_name_that_is_not_one_fetches_nothing(tmp_path):
    (_, fetched, refused), hits = asyncio.run(_fetch(tmp_path, {"segments": [_entry(GOOD)]}, node="../x"))
    assert fetched == 0 and hits == [] and "not a node name" in refused[0]
