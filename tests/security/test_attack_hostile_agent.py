"""The operator trusts no agent: a hostile one (a real aiohttp server here, the operator's real
client and fetch_new) cannot make it hold or write more than its bounds allow. Each broken bound
is AgentBroke, which marks that node failed; a stalled download is dropped after the idle time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from ingero_operator.agents import AgentBroke, AgentClient, AgentUnreachable
from ingero_operator.gather import LocalSession, fetch_new
from ingero_operator.settings import AgentSettings, GatherSettings

MTIME = 1_700_000_000_000_000_000


def _entry(i: int, size: int = 15) -> dict:
    return {"table": "nccl_events", "name": f"node-a__s1__{i}.parquet", "size": size, "mtime_ns": MTIME}


async def _endless(req, first: bytes = b"", stall_s: float | None = None):
    resp = web.StreamResponse()
    await resp.prepare(req)
    await resp.write(first)
    if stall_s is not None:
        await asyncio.sleep(stall_s)
    try:
        while True:
            await resp.write(b"x" * (1 << 16))
    except (ConnectionError, RuntimeError):
        pass
    return resp


@contextlib.asynccontextmanager
async def agent_at(app: web.Application, settings: AgentSettings | None = None, node: str = "node-a"):
    """An AgentClient of `node` talking to `app` served on 127.0.0.1."""
    runner = web.AppRunner(app, shutdown_timeout=0.5)     # a stalled handler is not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with aiohttp.ClientSession() as http:
            yield AgentClient(node, "127.0.0.1", site._server.sockets[0].getsockname()[1], "t",
                              settings or AgentSettings(), http)
    finally:
        await runner.cleanup()


async def _run(tmp_path: Path, listing, segment=None, agent: AgentSettings | None = None,
               gather: GatherSettings | None = None):
    async def segments(req):
        return await listing(req) if callable(listing) else web.json_response(listing)

    async def one(req):
        return await segment(req) if segment else web.Response(body=b"PAR1 not really")

    app = web.Application()
    app.router.add_get("/v1/sessions/s1/segments", segments)
    app.router.add_get("/v1/sessions/s1/segments/{tail:.*}", one)
    async with agent_at(app, agent) as client:
        return await fetch_new(client, "s1", LocalSession(tmp_path / "s"), 0, asyncio.Semaphore(2),
                               gather or GatherSettings())


def _files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.parametrize("how", ["sized", "endless"])
def test_a_listing_past_its_byte_cap_breaks_the_bound(tmp_path, how):
    big = b'{"segments": [' + b" " * (2 << 20)          # 2 MiB, never closed
    listing = (lambda req: _endless(req, b'{"segments": [')) if how == "endless" else \
        (lambda req: asyncio.sleep(0, web.Response(body=big, content_type="application/json")))
    t0 = time.monotonic()
    with pytest.raises(AgentBroke, match="answered more than 1048576 bytes|answered 2097166 bytes"):
        asyncio.run(_run(tmp_path, listing, agent=AgentSettings(listing_max_bytes=1 << 20)))
    assert time.monotonic() - t0 < 10 and _files(tmp_path) == []


def test_a_listing_of_more_entries_than_allowed_writes_nothing(tmp_path):
    listing = {"segments": [_entry(i) for i in range(101)]}
    with pytest.raises(AgentBroke, match="listed 101 segments; at most 100"):
        asyncio.run(_run(tmp_path, listing, gather=GatherSettings(listing_max_entries=100)))
    assert _files(tmp_path) == []


@pytest.mark.parametrize("how", ["larger", "endless"])
def test_a_segment_larger_than_listed_is_dropped_and_breaks_the_bound(tmp_path, how):
    body = (lambda req: _endless(req)) if how == "endless" else \
        (lambda req: asyncio.sleep(0, web.Response(body=b"x" * (200 << 10))))
    with pytest.raises(AgentBroke, match="more than 1039 bytes|answered 204800 bytes"):
        asyncio.run(_run(tmp_path, {"segments": [_entry(0)]}, body, gather=GatherSettings(size_slack_bytes=1024)))
    assert _files(tmp_path) == []            # no part file left either


def test_segments_past_the_node_or_session_cap_are_not_fetched(tmp_path):
    listing = {"segments": [_entry(0, 60), _entry(1, 60)]}
    for gather, flag in ((GatherSettings(node_max_bytes=100), "--node-max-bytes 100"),
                         (GatherSettings(session_max_bytes=100), "--session-max-bytes 100")):
        with pytest.raises(AgentBroke, match=f"120 bytes\\) would take the .* segments past {flag}"):
            asyncio.run(_run(tmp_path, listing, gather=gather))
    assert _files(tmp_path) == []


def test_a_download_that_stalls_is_dropped_after_the_idle_time(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AgentUnreachable, match="sent no byte for 0.5 s") as e:
        asyncio.run(_run(tmp_path, {"segments": [_entry(0, 1 << 20)]}, lambda req: _endless(req, b"PAR1", 30),
                         agent=AgentSettings(download_idle_s=0.5)))
    assert not isinstance(e.value, AgentBroke) and time.monotonic() - t0 < 10 and _files(tmp_path) == []


def test_a_node_that_breaks_a_bound_is_failed_at_once_and_named_in_the_gather_warnings(tmp_path):
    """The controller's gathering of one node (stop, clock, segments), its agent answering a
    listing of too many entries: no retry, the node's row says failed, the warning names why."""
    from ingero_operator.session import Controller, Live, Ref
    from ingero_operator.settings import Settings

    listings = []

    async def go():
        async def stop(req):
            return web.json_response({"state": "stopped", "pods": 1})

        async def now(req):
            return web.json_response({"wall_ns": time.time_ns(), "mono_ns": time.monotonic_ns()})

        async def segments(req):
            listings.append(req.path)
            return web.json_response({"segments": [_entry(i) for i in range(11)]})

        ref = Ref("default", "job", "0123456789abcdef")
        app = web.Application()
        app.router.add_post(f"/v1/sessions/{ref.sid}/stop", stop)
        app.router.add_get("/v1/time", now)
        app.router.add_get(f"/v1/sessions/{ref.sid}/segments", segments)
        settings = Settings(artifacts_dir=tmp_path)
        settings.gather.listing_max_entries = 10
        settings.timing.clock_samples = 1
        async with agent_at(app, settings.agent) as client:
            return await Controller(settings, kube=None)._gather_nodes(ref, Live(), {"node-a": client}, ["node-a"])

    gathered, warnings, rows = asyncio.run(go())
    assert gathered == [] and len(listings) == 1, listings
    assert rows[0]["name"] == "node-a" and rows[0]["state"] == "failed", rows
    assert len(warnings) == 1 and warnings[0].startswith("node node-a failed: agent on node-a (")
    assert warnings[0].endswith("listed 11 segments; at most 10 are taken; the report is partial: no data from it")


def test_the_folder_caps_count_downloads_as_they_land_without_walking_the_folder_again(tmp_path, monkeypatch):
    from ingero_operator import gather

    walks = []
    monkeypatch.setattr(gather, "_NODE_BYTES", {})
    monkeypatch.setattr(gather, "disk_bytes", lambda folder, real=gather.disk_bytes: walks.append(folder) or real(folder))
    g = GatherSettings(node_max_bytes=4 * 15)          # four 15-byte segments
    got = asyncio.run(_run(tmp_path, {"segments": [_entry(0), _entry(1)], "cursor": 1}, gather=g))
    assert got[1] == 2
    with pytest.raises(AgentBroke, match="--node-max-bytes 60"):      # 30 held + 45 new
        asyncio.run(_run(tmp_path, {"segments": [_entry(i) for i in range(5)], "cursor": 2}, gather=g))
    got = asyncio.run(_run(tmp_path, {"segments": [_entry(i) for i in range(4)], "cursor": 3}, gather=g))
    assert got[1] == 2                                 # 30 held + 30 new fit
    assert len(walks) == 1, walks                      # the node's folder was walked once
