"""`ingero mcp` through the MCP SDK's own client: stdio subprocess, and streamable HTTP with a token."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest

pytest.importorskip("mcp", reason="the MCP SDK is not installed: pip install -e '.[mcp]'")

import httpx2  # noqa: E402  (the SDK's HTTP client)
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from ingero.cli import main  # noqa: E402
from ingero.merge import merge  # noqa: E402
from tests.unit.trace_fixture import TOKEN, spawn_mcp_http, write_crafted, write_job  # noqa: E402

TOOLS = {"list_sessions", "straggler_report", "rank_detail", "describe_tables", "query"}
ART = "ns/job/trace.duckdb"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mcp")
    write_job(d / "raw")
    (d / "ns" / "job").mkdir(parents=True)
    merge([d / "raw"], d / ART)
    (d / "ns" / "job" / "report.json").write_text("{}")
    (d / "secret.txt").write_text("outside every trace")
    write_crafted(d)
    return d


def text(res) -> dict:
    assert not res.is_error, res.content[0].text
    return json.loads(res.content[0].text)


async def exercise(session: ClientSession) -> dict:
    """List the tools and call each one; returns what came back."""
    await session.initialize()
    listed = (await session.list_tools()).tools
    got = {"tools": {t.name: t for t in listed}}
    got["sessions"] = text(await session.call_tool("list_sessions", {}))
    got["report"] = text(await session.call_tool("straggler_report", {"session": ART}))
    got["rank"] = text(await session.call_tool("rank_detail", {"session": ART, "rank": 3, "latest": 3}))
    got["tables"] = text(await session.call_tool("describe_tables", {}))
    got["query"] = text(await session.call_tool("query", {"session": ART, "sql":
                                                          "SELECT COUNT(*) FROM tcp_events WHERE event = "
                                                          "'tcp_retransmit_skb'"}))
    got["refused"] = await session.call_tool("query", {"session": ART, "sql": "COPY nccl_events TO 'x.csv'"})
    got["outside"] = await session.call_tool("query", {"session": "../../etc", "sql": "SELECT 1"})
    got["no_rank"] = await session.call_tool("rank_detail", {"session": ART, "rank": 42})
    for view in ("rel", "leak", "leak_tmp"):
        got[view] = await session.call_tool("query", {"session": "crafted/trace.duckdb",
                                                      "sql": f"SELECT * FROM {view}"})
    got["huge_rows"] = await session.call_tool("query", {"session": ART, "sql": "SELECT 1",
                                                         "max_rows": 10 ** 4299})
    got["crafted_report"] = await session.call_tool("straggler_report", {"session": "crafted/trace.duckdb"})
    got["crafted_rank"] = await session.call_tool("rank_detail", {"session": "crafted/trace.duckdb", "rank": 0})
    return got


def check(got: dict) -> None:
    tools = got["tools"]
    assert set(tools) == TOOLS
    for t in tools.values():   # enough for an assistant to use without our docs
        assert len(t.description) > 150 and t.annotations.read_only_hint, t.name
    assert set(tools["rank_detail"].input_schema["properties"]) == {"session", "rank", "latest"}
    names = {s["session"]: s["kind"] for s in got["sessions"]["sessions"]}
    assert names[ART] == "artifact" and names["raw/node-a"] == "segments" and names["raw/node-b"] == "segments"
    s = got["report"]["straggler"]
    assert (s["rank"], s["node"]) == (3, "node-b") and s["evidence"] and len(got["report"]["ranks"]) == 4
    assert (got["report"]["verdict"], got["report"]["cannot_judge"], got["report"]["hang"]) == ("straggler", None, None)
    r = got["rank"]
    assert r["rank"] == 3 and r["is_straggler"] and r["per_op"]["ALL_REDUCE"]["calls"] == 20
    assert len(r["latest"]) == 3 and all(x["op"] == "ALL_REDUCE" and x["late_ms"] > 5 for x in r["latest"])
    assert "nccl_events" in got["tables"]["tables"] and got["tables"]["examples"]
    assert got["query"]["rows"] == [[11]]
    for key, words in (("refused", "COPY statements are not allowed"), ("outside", "outside the root"),
                       ("no_rank", "rank 42 is not in"), ("huge_rows", "max_rows must be a finite number")):
        assert got[key].is_error and words in got[key].content[0].text, got[key].content[0].text
    # a crafted trace reads its own files only: not DuckDB's temp folder, nor a relative name in the
    # server's working directory; its tools answer with an error, not a traceback
    assert text(got["rel"])["rows"] == [["the trace"]]
    for key in ("leak", "leak_tmp", "crafted_report", "crafted_rank"):
        msg = got[key].content[0].text
        assert got[key].is_error and "Permission" in msg and "\n" not in msg, msg


def test_stdio_client_lists_the_tools_and_calls_each_one(root, tmp_path):
    params = StdioServerParameters(command=sys.executable, args=["-m", "ingero", "mcp", "--root", str(root)],
                                   cwd=root)

    async def go():
        with open(tmp_path / "stderr", "w") as errlog:
            async with stdio_client(params, errlog=errlog) as (r, w):
                async with ClientSession(r, w) as session:
                    return await exercise(session)

    check(anyio.run(go))
    assert "Traceback" not in (tmp_path / "stderr").read_text()


@pytest.fixture(scope="module")
def http_server(root, tmp_path_factory):
    tok = tmp_path_factory.mktemp("tok") / "token"
    tok.write_text(TOKEN)
    proc, port = spawn_mcp_http(root, tok, cwd=root)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def test_http_client_with_the_token_lists_the_tools_and_calls_each_one(http_server):
    async def go():
        # the timeouts of the SDK's own client (30 s, 300 s to read a response stream): httpx's
        # default 5 s read ended a tool call's stream at load ~30 ("SSE stream ended without a
        # response") while the server was still judging the trace
        timeout = httpx2.Timeout(30, read=300)
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=timeout) as http:
            async with streamable_http_client(http_server, http_client=http) as (r, w):
                async with ClientSession(r, w) as session:
                    return await exercise(session)

    check(anyio.run(go))


def test_http_without_or_with_a_wrong_token_gets_401_and_the_client_cannot_connect(http_server):
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
        req = urllib.request.Request(http_server, data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json", **headers})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401

    async def go():
        with anyio.fail_after(20):
            async with httpx2.AsyncClient() as http:
                async with streamable_http_client(http_server, http_client=http) as (r, w):
                    async with ClientSession(r, w) as session:
                        await session.initialize()

    with pytest.raises(BaseException) as e:
        anyio.run(go)
    assert not isinstance(e.value, TimeoutError)


def test_http_needs_a_token_file_and_a_bad_root_is_one_line(root, tmp_path, capsys):
    assert main(["mcp", "--root", str(root), "--http", "127.0.0.1:1"]) == 2
    assert main(["mcp", "--root", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--token-file" in err[0] and "is not a folder" in err[1]


def test_queries_on_an_operator_artifact_read_its_segment_view_and_nothing_else(tmp_path):
    import shutil

    from ingero import readonly_sql
    from ingero_operator.gather import LocalSession, build_artifact

    write_job(tmp_path / "seg")
    local = LocalSession(tmp_path / "root" / "default" / "job")
    for node in ("node-a", "node-b"):
        shutil.copytree(tmp_path / "seg" / node, local.node_dir(node))
    build_artifact(local, {"node-a": 0, "node-b": 0})
    got = readonly_sql.query(local.artifact, "SELECT node, count(*) FROM nccl_events GROUP BY ALL ORDER BY 1")
    assert got.rows == [["node-a", 120], ["node-b", 120]]
    for sql in ("SELECT * FROM read_csv('/etc/passwd')",
                f"SELECT count(*) FROM read_parquet('{tmp_path}/seg/node-a/nccl_events/*.parquet')"):
        with pytest.raises(readonly_sql.QueryRefused, match="file system operations are disabled"):
            readonly_sql.query(local.artifact, sql)
