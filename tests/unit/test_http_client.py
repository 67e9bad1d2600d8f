"""ingero.http_client: the one client stack (operator -> agents and API server, `ingero fleet`):
failures are one line naming the address and why, segments stream to a file atomically."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from ingero.errors import IngeroError
from ingero.http_client import Agent, AgentError, Tls, new_session
from tests.unit.trace_fixture import SESSION, TOKEN, agent_data, serve_agent


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _with_agent(port: int, fn, token: str = TOKEN):
    async with new_session() as http:
        return await fn(Agent("127.0.0.1", port, token, http, timeout_s=5))


def test_a_dead_agent_is_one_line_naming_its_address_and_the_reason():
    port = closed_port()
    with pytest.raises(AgentError) as e:
        asyncio.run(_with_agent(port, lambda a: a.call("GET", "/healthz")))
    assert str(e.value) == f"unreachable at 127.0.0.1:{port} (Connection refused)" and e.value.status is None


def test_an_answer_that_is_not_json_or_an_error_status_says_so_with_the_status():
    async def text(_):
        return web.Response(text="<html>proxy error</html>")

    async def gone(_):
        return web.json_response({"error": "session x is not known"}, status=404)

    async def main():
        app = web.Application()
        app.router.add_get("/text", text)
        app.router.add_get("/gone", gone)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            async with new_session() as http:
                agent = Agent("127.0.0.1", port, TOKEN, http)
                out = []
                for path in ("/text", "/gone"):
                    try:
                        await agent.call("GET", path)
                    except AgentError as e:
                        out.append((str(e), e.status))
                out.append(await agent.call("GET", "/gone", missing_ok=True))
                return out
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == [("answered 200 with something that is not JSON", 200),
                                   ("answered 404: session x is not known", 404), None]


def test_a_segment_streams_into_its_file_and_a_refused_one_leaves_no_part_file(tmp_path):
    srv, _ = serve_agent(agent_data(tmp_path / "data", "n1", [0]), "n1")
    seg = next((tmp_path / "data" / "sessions" / SESSION / "segments" / "nccl_events").iterdir())
    try:
        async def fetch(agent: Agent):
            n = await agent.fetch(f"/v1/sessions/{SESSION}/segments/nccl_events/{seg.name}",
                                  tmp_path / "got" / seg.name, 10, mtime_ns=1_000_000_000)
            with pytest.raises(AgentError, match="answered 404"):
                await agent.fetch(f"/v1/sessions/{SESSION}/segments/nccl_events/none.parquet",
                                  tmp_path / "got" / "none.parquet", 10)
            return n

        n = asyncio.run(_with_agent(srv.server_address[1], fetch))
    finally:
        srv.shutdown()
        srv.server_close()
    got = tmp_path / "got" / seg.name
    assert n == seg.stat().st_size and got.read_bytes() == seg.read_bytes()
    assert got.stat().st_mtime_ns == 1_000_000_000
    assert sorted(p.name for p in got.parent.iterdir()) == [seg.name]


def test_tls_files_that_cannot_be_loaded_are_one_line_naming_them(tmp_path):
    with pytest.raises(IngeroError) as e:
        Tls(ca_file=str(tmp_path / "ca.pem")).context()
    assert "ca.pem" in str(e.value) and "\n" not in str(e.value)


def test_the_api_server_unreachable_is_a_kube_error_of_one_line():
    pytest.importorskip("kopf", reason="the operator's dependencies are not installed")
    import kopf

    from ingero_operator.kube import Kube, KubeError

    port = closed_port()

    async def main():
        kube = Kube(kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}"))
        try:
            await kube.list_pods("default", {"app": "x"})
        finally:
            await kube.close()

    with pytest.raises(KubeError) as e:
        asyncio.run(main())
    assert e.value.status == 0 and "Connection refused" in str(e.value) and "\n" not in str(e.value)
