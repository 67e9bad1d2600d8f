"""A whole session with hostile agents on two of its nodes: the real operator process (the flow
of tests/unit/operator_flow.py), two honest agents, and two agents that answer everything as a
real agent does but lie in their segment listings: one sends a listing that never ends (the
operator reads at most 48 MiB of it), one lists 8 segments of 15 bytes and
sends each without end. The session completes from the honest nodes; the hostile ones are named
failed in its warnings; the operator's memory and disk stay bounded."""

from __future__ import annotations

import re
import sys

import aiohttp
import pytest
from aiohttp import web

from ingero import serving
from ingero_operator import cluster_objects as objs
from tests.security.attacks import vm
from tests.unit.operator_flow import FAKE_TRACER, started
from tests.unit.trace_fixture import serve_agent

NODE_MAX = 16 << 20          # --node-max-bytes of the operator here


async def _forever(request: web.Request, first: bytes, piece: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(first)
    try:
        while True:
            await resp.write(piece)
    except (ConnectionError, RuntimeError):
        return resp


def hostile(node: str, real_port: int, how: str) -> serving.ServerThread:
    """An agent for `node`: every request forwarded to the real agent at `real_port`, but the
    segment listing (`how`: "endless" listing, or "lying" sizes with endless bodies)."""
    async def forward(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as http:
            async with http.request(request.method, f"http://127.0.0.1:{real_port}{request.path_qs}",
                                    data=await request.read(), headers={
                                        "Authorization": request.headers.get("Authorization", "")}) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def listing(request: web.Request) -> web.StreamResponse:
        if how == "endless":
            return await _forever(request, b'{"segments": [', b" " * (1 << 20))
        sid = request.match_info["sid"]
        return web.json_response({"segments": [
            {"table": "nccl_events", "name": f"{node}__{sid}__{i}.parquet", "size": 15, "mtime_ns": 1}
            for i in range(8)], "cursor": 2})

    async def segment(request: web.Request) -> web.StreamResponse:
        return await _forever(request, b"PAR1", b"x" * (1 << 20))

    app = web.Application()
    app.router.add_get("/v1/sessions/{sid}/segments", listing)
    app.router.add_get("/v1/sessions/{sid}/segments/{table}/{name}", segment)
    app.router.add_route("*", "/{tail:.*}", forward)
    return serving.ServerThread(app, serving.bind(0, "127.0.0.1"), name=f"hostile-{node}").start()


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    yield from started(tmp_path_factory, "hostile-session", operator_args=("--node-max-bytes", str(NODE_MAX)))


def test_a_session_with_hostile_agents_completes_and_names_them_with_bounded_memory_and_disk(flow):
    servers = []
    try:
        for node, how in (("node-h1", "endless"), ("node-h2", "lying")):
            real, _ = serve_agent(flow.tmp / node, node, trace_cmd=[sys.executable, str(FAKE_TRACER), "--ranks", "0"])
            servers.append(real)
            fake = hostile(node, real.server_address[1], how)
            servers.append(fake)
            flow.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/pods", objs.agent_pod(node, fake.port))
        for rank, node in enumerate(("node-a", "node-a", "node-b", "node-b", "node-h1", "node-h2")):
            flow.rank_pod("hostile", rank, node)
        flow.apply("hostile", selector={"matchLabels": {"job-name": "hostile"}}, durationSeconds=3)
        st = flow.wait_for("hostile", lambda s: s.get("phase") in ("Completed", "Failed"), timeout=120)
        warnings = "\n".join(st.get("warnings") or [])
        hwm = vm(flow.operator.pid, "VmHWM")
        disk = sum(p.stat().st_size for p in (flow.tmp / "artifacts").rglob("*") if p.is_file())
        print(f"hostile session: {st['phase']}, operator VmHWM {hwm:.0f} MiB, artifacts {disk / 2**20:.1f} MiB")
        assert st["phase"] == "Completed", st
        assert re.search(r"node node-h1 failed: .*answered more than 50331648 bytes for \S+/segments;", warnings)
        assert re.search(r"node node-h2 failed: .*answered more than 1048591 bytes for \S+/node-h2__", warnings)
        assert {r["name"]: r["state"] for r in st["nodes"]}.keys() >= {"node-h1", "node-h2"}
        assert all(r["state"] == "failed" for r in st["nodes"] if r["name"].startswith("node-h")), st["nodes"]
        assert hwm < 512 and disk < 2 * NODE_MAX, (hwm, disk)
        kept = [p for p in (flow.tmp / "artifacts").rglob("*node-h*") if p.is_file()]
        assert not [p for p in kept if p.stat().st_size > 15 + (1 << 20)], kept     # listed size + slack
    finally:
        for s in servers:
            if isinstance(s, serving.ServerThread):
                s.stop()
            else:
                s.shutdown()
                s.server_close()

