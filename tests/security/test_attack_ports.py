"""Every port against a crowd: half-open connections, slow readers and many ordinary clients
cost a bounded amount, and a legitimate request is served within 2 s throughout
(``ingero.serving``). Each attack runs against the real server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import ssl
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from ingero import serving
from ingero_operator.cluster_objects import free_port
from tests.security.attacks import half_open, self_signed, throughout, vm
from tests.unit.trace_fixture import TOKEN, agent_data, serve_agent, spawn_agent, spawn_mcp_http

pytest.importorskip("ingero_operator.artifact_server")
from ingero_operator import artifact_server as art  # noqa: E402


def timed_get(url: str, token: str | None = TOKEN, timeout: float = 5.0, context=None) -> tuple[int, float]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            r.read()
            return r.status, time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, time.monotonic() - t0


# ---- the agent, as the chart runs it: API and metrics, memory bounded ------------------------
@pytest.fixture
def agent_proc(tmp_path):
    mport = free_port()
    agent_data(tmp_path / "data", "n1", [0, 1])
    proc, port = spawn_agent(tmp_path, "--max-memory-mb", "768", "--query-memory-mb", "192",
                             "--metrics-port", str(mport), "--metrics-address", "127.0.0.1")
    yield proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"
    proc.terminate()
    proc.wait(10)


def test_500_half_open_metrics_connections_neither_crash_the_agent_nor_delay_a_scrape(agent_proc):
    proc, api, metrics = agent_proc
    assert timed_get(metrics, None)[0] == 200
    rss0 = vm(proc.pid, "VmRSS")
    socks = half_open(int(metrics.split(":")[2].split("/")[0]), 500)
    try:
        statuses, ms = throughout(lambda: timed_get(metrics, None)[0])
        grew = vm(proc.pid, "VmRSS") - rss0
        print(f"agent metrics under 500 half-open: RSS +{grew:.1f} MiB")
        assert proc.poll() is None, proc.stderr.read()
        assert statuses == {200} and ms[-1] < 2000 and grew < 50, (statuses, ms, grew)
        assert timed_get(f"{api}/v1/time")[0] == 200
        assert vm(proc.pid, "VmData") < 768
    finally:
        for s in socks:
            s.close()


def test_50_concurrent_clients_of_the_api_and_metrics_get_no_5xx(agent_proc):
    proc, api, metrics = agent_proc
    query = json.dumps({"sql": "SELECT rank, count(*) FROM nccl_events GROUP BY ALL"}).encode()

    def client(i: int) -> list[tuple[str, int]]:
        out = []
        for k in range(6):
            if k % 3 == 0:
                req = urllib.request.Request(f"{api}/v1/query", data=query, headers={
                    "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
            else:
                req = urllib.request.Request(metrics if k % 3 == 1 else f"{api}/v1/time",
                                             headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                    out.append((req.full_url.rsplit("/", 1)[1], r.status))
            except urllib.error.HTTPError as e:
                out.append((req.full_url.rsplit("/", 1)[1], e.code))
        return out

    with ThreadPoolExecutor(50) as pool:
        got = [s for answers in pool.map(client, range(50)) for s in answers]
    assert proc.poll() is None, proc.stderr.read()
    assert len(got) == 300
    assert {s for kind, s in got if kind != "query"} == {200}, got     # clock samples and scrapes: all served
    assert {s for kind, s in got if kind == "query"} <= {200, 429}, got  # 429: both query slots busy
    assert vm(proc.pid, "VmHWM") < 768


# ---- the agent API: a slowloris of 500 ---------------------------------------------------------
def test_a_slowloris_of_500_connections_does_not_keep_clock_samples_out(tmp_path):
    srv, _ = serve_agent(agent_data(tmp_path / "data", "n1", [0]), "n1")
    port = srv.server_address[1]
    try:
        socks = half_open(port, 500, b"GET /v1/time HTTP/1.1\r\nHost: x\r\n")
        lat = [timed_get(f"http://127.0.0.1:{port}/v1/time") for _ in range(40)]
        assert all(status == 200 for status, _ in lat), lat
        ms = sorted(t * 1e3 for _, t in lat)
        assert ms[-1] < 2000, ms
        print(f"/v1/time under 500 half-open: p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms")
        for s in socks:
            s.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_500_silent_tls_connections_cost_the_agent_under_50_mib_and_delay_no_clock_sample(tmp_path):
    """The agent API as the chart serves it (TLS): TCP peers that never say hello, each with
    a handshake under way until a new client takes its slot or the idle timeout ends it."""
    cert, key = self_signed(tmp_path / "pki")
    agent_data(tmp_path / "data", "n1", [0])
    proc, port = spawn_agent(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), "--max-memory-mb", "768")
    ctx = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}/v1/time"
    try:
        assert timed_get(url, context=ctx)[0] == 200
        rss0 = vm(proc.pid, "VmRSS")
        socks = half_open(port, 500, b"")
        statuses, ms = throughout(lambda: timed_get(url, context=ctx)[0])
        grew = vm(proc.pid, "VmRSS") - rss0
        print(f"agent TLS /v1/time under 500 silent connections: RSS +{grew:.1f} MiB")
        assert statuses == {200} and ms[-1] < 2000 and grew < 50, (statuses, ms, grew)
        assert proc.poll() is None
        for s in socks:
            s.close()
    finally:
        proc.terminate()
        proc.wait(10)


# ---- the operator's ports ---------------------------------------------------------------------
def test_the_operator_metrics_port_holds_500_half_open_connections_without_a_thread_each():
    from ingero_operator import metrics

    srv = metrics.serve(0, "127.0.0.1")
    try:
        threads, rss0 = threading.active_count(), vm(os.getpid(), "VmRSS")    # (served in this process)
        socks = half_open(srv.port, 500)
        statuses, ms = throughout(lambda: timed_get(f"http://127.0.0.1:{srv.port}/metrics", None)[0])
        grew = vm(os.getpid(), "VmRSS") - rss0
        print(f"operator metrics under 500 half-open: RSS +{grew:.1f} MiB")
        assert statuses == {200} and ms[-1] < 2000 and grew < 50, (statuses, ms, grew)
        assert threading.active_count() - threads <= 2
        for s in socks:
            s.close()
    finally:
        srv.stop()


@pytest.fixture
def artifacts(tmp_path):
    root = tmp_path / "artifacts"
    folder = root / "default" / "job-1234abcd"
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({"ok": True}))
    (folder / "trace.duckdb").write_bytes(os.urandom(16 << 20))     # far more than the socket buffers
    key = art.write_key(folder)
    srv = art.serve(root, 0, "127.0.0.1", serving.Bounds(idle_timeout_s=3.0))
    yield srv, f"http://127.0.0.1:{srv.port}/v1/artifacts/default/job/{{}}?key={key}"
    srv.stop()


def _slow_reader(port: int, path: str) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def test_slow_readers_of_artifacts_block_no_other_download_and_are_dropped(artifacts):
    srv, url = artifacts
    readers = [_slow_reader(srv.port, url.format(f).split(str(srv.port), 1)[1])
               for f in ["artifact.tar"] * 8 + ["trace.duckdb"] * 8]
    try:
        time.sleep(0.5)
        for _ in range(3):
            status, took = timed_get(url.format("report.json"), None)
            assert status == 200 and took < 2, (status, took)
        status, _ = timed_get(url.format("artifact.tar"), None, timeout=2)
        assert status == 503                   # every tar stream is taken by a stalled reader
        time.sleep(5.0)                        # the idle timeout (3 s here) drops the stalled readers
        assert srv.slots.open == 0
        req = urllib.request.urlopen(url.format("artifact.tar"), timeout=30)
        assert req.status == 200 and len(req.read()) > 16 << 20
    finally:
        for s in readers:
            s.close()


def test_500_half_open_connections_to_the_artifact_server_delay_no_download(artifacts):
    srv, url = artifacts
    rss0 = vm(os.getpid(), "VmRSS")                     # (served in this process)
    socks = half_open(srv.port, 500, b"GET /v1/artifacts/default/job/report.json HTTP/1.1\r\n")
    try:
        statuses, ms = throughout(lambda: timed_get(url.format("report.json"), None)[0])
        grew = vm(os.getpid(), "VmRSS") - rss0
        print(f"artifacts under 500 half-open: RSS +{grew:.1f} MiB")
        assert statuses == {200} and ms[-1] < 2000 and grew < 50, (statuses, ms, grew)
    finally:
        for s in socks:
            s.close()


# ---- the MCP server over HTTP ---------------------------------------------------------------
@pytest.fixture
def mcp_http(tmp_path):
    pytest.importorskip("mcp")
    from tests.unit.trace_fixture import write_job

    write_job(tmp_path / "raw")
    (tmp_path / "token").write_text(TOKEN)
    proc, port = spawn_mcp_http(tmp_path / "raw", tmp_path / "token", "--max-memory-mb", "768",
                                "--query-memory-mb", "64")
    yield proc, port
    proc.terminate()
    proc.wait(10)


def _mcp_call(port: int, tool: str, args: dict):
    import anyio
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def go():
        with anyio.fail_after(60):
            async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
                async with streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http) as (r, w):
                    async with ClientSession(r, w) as session:
                        await session.initialize()
                        return await session.call_tool(tool, args)

    return anyio.run(go)


def _timed_session(port: int):
    t0 = time.monotonic()
    res = _mcp_call(port, "list_sessions", {})      # a whole client session: connect, initialize, call
    return res, time.monotonic() - t0


def test_500_half_open_connections_to_the_mcp_server_delay_no_client(mcp_http):
    """The delay is the session's time less the same session's before the connections: a
    whole client session (its client in this process) takes 1-2 s at load 30 by itself."""
    proc, port = mcp_http
    _, before = _timed_session(port)
    rss0 = vm(proc.pid, "VmRSS")
    socks = half_open(port, 500, b"POST /mcp HTTP/1.1\r\n")
    try:
        time.sleep(0.5)
        res, took = _timed_session(port)
        grew = vm(proc.pid, "VmRSS") - rss0
        print(f"ingero mcp --http under 500 half-open: a client session in {took * 1e3:.0f} ms "
              f"({before * 1e3:.0f} ms before them); RSS +{grew:.1f} MiB")
        assert not res.is_error and took - before < 2 and grew < 50, (res, took, before, grew)
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()


def test_a_query_allocating_gigabytes_is_a_tool_error_naming_the_flags_and_the_mcp_server_stays(mcp_http):
    proc, port = mcp_http
    res = _mcp_call(port, "query", {"session": ".", "sql": "SELECT repeat('x', 1073741000) AS s"})
    assert res.is_error and "--query-memory-mb 64" in res.content[0].text, res.content[0].text
    print(f"ingero mcp repeat('x', 1073741000): a tool error, VmHWM {vm(proc.pid, 'VmHWM'):.0f} MiB")
    assert "--max-memory-mb 768" in res.content[0].text and "\n" not in res.content[0].text
    assert proc.poll() is None and vm(proc.pid, "VmHWM") < 768
    assert not _mcp_call(port, "describe_tables", {}).is_error


def test_one_address_crowding_the_port_drops_its_own_connections_not_another_clients(tmp_path):
    import http.client

    srv, _ = serve_agent(agent_data(tmp_path / "data", "n1", [0]), "n1", max_connections=8, idle_timeout_s=5)
    port = srv.server_address[1]
    try:
        keep = http.client.HTTPConnection("127.0.0.1", port, timeout=5)     # an operator's keep-alive
        for _ in range(2):
            keep.request("GET", "/v1/time", headers={"Authorization": f"Bearer {TOKEN}"})
            assert keep.getresponse().read() and srv.slots.open == 1
            crowd = []
            for _ in range(20):                 # another address: 127.0.0.2 (still loopback)
                s = socket.socket()
                s.bind(("127.0.0.2", 0))
                s.connect(("127.0.0.1", port))
                s.sendall(b"GET /v1/time HTTP/1.1\r\n")
                crowd.append(s)
            time.sleep(0.3)
            assert srv.slots.by_address == {"127.0.0.1": 1, "127.0.0.2": 4}, srv.slots.by_address
            for s in crowd:
                s.close()
            time.sleep(0.2)
        keep.close()
    finally:
        srv.shutdown()
        srv.server_close()
