"""Fleet queries, offline merge, the Perfetto timeline and the MCP server on one real lab session.

One lossy-link lab job (2 nodes x 2 ranks, real eBPF) traced by one
`ingero agent serve` per lab node, driven through the agent API as the
operator drives it, then gathered as the operator gathers (clock offsets
measured, segments fetched, ``gather.build_artifact``). The tests share that
session: fan-out with one agent stopped, merge of copied segments against the
operator's artifact, a timeline a reviewer can open, and the MCP client.
Needs root and eBPF; about 25 s for the session.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ingero import schema
from ingero.readonly_sql import open_source
from tests.conftest import bpf_reason, wait_until

pytestmark = pytest.mark.bpf
REPO = Path(__file__).resolve().parents[2]
SECONDS = 8.0
TOKEN = "fleet-flow-token-0123456789abcdef"
SCHEMA = REPO / "tests" / "unit" / "chrome_trace_event.schema.json"
TIMELINE = REPO / "out" / "fleet-flow" / "lossy-link-timeline.json"


def _call(port: int, method: str, path: str, body=None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    reason = bpf_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("aiohttp", reason="the operator's dependencies are needed for its gather")
    from ingero.lab.cgroups import node_cgroup_root
    from ingero.lab.runner import LabConfig, LabRun
    from ingero_operator.agents import AgentClient
    from ingero_operator.gather import LocalSession, build_artifact, fetch_new
    from ingero_operator.settings import AgentSettings

    out = tmp_path_factory.mktemp("fleet-flow")
    (out / "token").write_text(TOKEN)
    agents: dict[str, dict] = {}
    facts: dict = {"out": out, "agents": agents}
    try:
        with LabRun(LabConfig(scenario="lossy-link", seconds=SECONDS, out_dir=out / "lab"), log=lambda _m: None) as lab:
            sid = f"default.fleet-flow.{lab.run_id}"
            for node in lab.nodes:
                port = _free_port()
                data, ready = out / "agents" / node.name, out / f"{node.name}.ready"
                log = open(out / f"agent-{node.name}.log", "wb")
                proc = subprocess.Popen(
                    [sys.executable, "-m", "ingero", "agent", "serve", "--node", node.name, "--listen",
                     f"127.0.0.1:{port}", "--data-dir", str(data), "--token-file", str(out / "token"),
                     "--ready-file", str(ready), "--cgroup-root", str(node_cgroup_root(lab.run_id, node.name)),
                     "--quiet"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
                log.close()
                agents[node.name] = {"proc": proc, "port": port, "segments": data / "sessions" / sid / "segments",
                                     "ready": ready}
            for name, a in agents.items():     # started side by side, then each waited for
                wait_until(lambda: a["ready"].exists() or a["proc"].poll() is not None, 30, f"agent {name}")
                assert a["proc"].poll() is None, (out / f"agent-{name}.log").read_text()
            for node in lab.nodes:
                pods = json.loads(lab.pods_file(node).read_text())["pods"]
                _call(agents[node.name]["port"], "POST", "/v1/sessions",
                      {"session_id": sid, "pods": pods, "nccl_lib": str(lab.binaries.libnccl)})
            for name, a in agents.items():
                wait_until(lambda: _call(a["port"], "GET", f"/v1/sessions/{sid}")["state"] == "running", 90,
                      f"probes attached on {name}")
            lab.start_ranks()
            codes = lab.wait()
            assert set(codes.values()) == {0}, codes
            facts.update(sid=sid, victim=lab.victim, victim_node=lab.victim_node.name,
                         steps={rp.rank: rp.stats["steps"] for rp in lab.ranks},
                         node_of={rp.rank: rp.node.name for rp in lab.ranks})
        for a in agents.values():        # stop every node's tracer, then wait until each has
            _call(a["port"], "POST", f"/v1/sessions/{sid}/stop", {})   # written everything and exited
        for name, a in agents.items():
            wait_until(lambda: _call(a["port"], "GET", f"/v1/sessions/{sid}")["exit_code"] is not None, 60,
                  f"the tracer on {name} to exit")

        async def gather():   # as the operator gathers: clock offsets, then every segment
            import aiohttp
            local = LocalSession(out / "operator" / "default" / "fleet-flow")
            async with aiohttp.ClientSession() as http:
                clients = {n: AgentClient(n, "127.0.0.1", a["port"], TOKEN, AgentSettings(), http)
                           for n, a in agents.items()}
                offsets = {n: (await c.clock_offset(8))[0] for n, c in clients.items()}
                sem = asyncio.Semaphore(8)
                for c in clients.values():
                    await fetch_new(c, sid, local, 0, sem)
            return local, offsets

        local, offsets = asyncio.run(gather())
        build_artifact(local, offsets)
        facts.update(local=local, offsets=offsets, artifact=local.artifact)
        yield facts
    finally:
        for a in agents.values():
            if a["proc"].poll() is None:
                a["proc"].send_signal(signal.SIGTERM)
                try:
                    a["proc"].wait(20)
                except subprocess.TimeoutExpired:
                    a["proc"].kill()
                    a["proc"].wait()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tables(path: Path) -> dict:
    con = open_source(path)
    try:
        return {t: sorted(con.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in schema.TABLES}
    finally:
        con.close()


def _report(path: Path) -> dict:
    from ingero.analysis import analyse
    con = open_source(path)
    try:
        return analyse(con).to_dict()
    finally:
        con.close()


def _answers(path: Path) -> dict:
    """The report's answers that do not hang on the step time: analysis picks the step's
    communicator among equally busy ones by row order, so on identical tables stored in another
    order step_ms (and what is scaled by it) can differ in the last digits."""
    r = _report(path)
    s = r["straggler"] or {}
    return {"straggler": {k: s.get(k) for k in ("rank", "node", "pod", "cause", "group")},
            "collectives": r["collectives"], "retransmits": r["retransmits"], "warnings": r["warnings"],
            "ranks": [{k: x[k] for k in ("rank", "node", "pod", "pid", "collectives", "p50_ms", "p99_ms", "late_ms",
                                         "last_share", "retransmits", "retransmits_in_window", "offcpu_ms",
                                         "per_op")} for x in r["ranks"]]}


# ---- fleet ----------------------------------------------------------------------------------

def test_fan_out_answers_from_every_agent_then_warns_naming_a_stopped_one(flow, tmp_path):
    from ingero.fleet import fan_out
    from ingero.fleet_targets import Target

    targets = [Target(n, "127.0.0.1", a["port"]) for n, a in flow["agents"].items()]
    sql = "SELECT global_rank, count(*) AS calls FROM nccl_events WHERE op = 'ALL_REDUCE' GROUP BY ALL ORDER BY 1"
    res = fan_out(targets, TOKEN, sql, timeout_s=10, show_clock=True)
    assert not res.warnings
    got = {(r[0], r[3]): r[4] for r in res.rows}
    assert got == {(flow["node_of"][r], r): steps for r, steps in flow["steps"].items()}
    assert all(abs(r[1]) < 5_000_000 and r[2] > 0 for r in res.rows)      # one machine: offsets ~0

    stopped = "lab-node-a"
    flow["agents"][stopped]["proc"].kill()
    flow["agents"][stopped]["proc"].wait()
    nodes = ",".join(f"{t.node}=127.0.0.1:{t.port}" for t in targets)
    proc = subprocess.run([sys.executable, "-m", "ingero", "fleet", "query", sql, "--nodes", nodes,
                           "--token-file", str(flow["out"] / "token"), "--format", "csv"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.strip().splitlines()
    assert rows[0] == "node,global_rank,calls" and {r.split(",")[0] for r in rows[1:]} == {"lab-node-b"}
    assert f"warning: node {stopped} left out: unreachable" in proc.stderr


# ---- merge ----------------------------------------------------------------------------------

def test_merging_segments_copied_from_the_nodes_gives_the_operators_gather(flow, tmp_path):
    for node, a in flow["agents"].items():
        shutil.copytree(a["segments"], tmp_path / "copied" / node)
    merged = tmp_path / "merged.duckdb"
    offsets = [f"--clock-offset={n}={o}" for n, o in flow["offsets"].items()]
    proc = subprocess.run([sys.executable, "-m", "ingero", "merge", *sorted((tmp_path / "copied").iterdir()),
                           "-o", str(merged), *offsets], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _tables(merged) == _tables(flow["artifact"])
    assert _answers(merged) == _answers(flow["artifact"])
    # without the offsets on the command line: the artifact knows them, the raw copies come back onto them
    again = tmp_path / "again.duckdb"
    subprocess.run([sys.executable, "-m", "ingero", "merge", str(tmp_path / "copied"), str(flow["artifact"]),
                    "-o", str(again)], check=True, capture_output=True, cwd=REPO, timeout=120)
    assert _tables(again) == _tables(flow["artifact"])


# ---- Perfetto -----------------------------------------------------------------------------

def test_the_lossy_link_timeline_has_a_slice_for_every_collective_of_every_rank_and_the_arrows(flow, capsys):
    import jsonschema

    TIMELINE.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "ingero", "export", "perfetto", str(flow["artifact"]), "-o",
                           str(TIMELINE)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(TIMELINE.read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    con = open_source(flow["artifact"])
    want = dict(con.execute("""SELECT COALESCE(r.rank, e.global_rank), count(*) FROM nccl_events e
        LEFT JOIN (SELECT node, pid, any_value(rank) AS rank FROM ranks GROUP BY ALL) r USING (node, pid)
        WHERE e.op IN ('ALL_REDUCE', 'ALL_GATHER', 'REDUCE_SCATTER', 'BROADCAST', 'REDUCE') GROUP BY 1""").fetchall())
    links = con.execute("""SELECT sum(n - 1) FROM (SELECT count(*) AS n FROM nccl_events
        WHERE op IN ('ALL_REDUCE', 'ALL_GATHER', 'REDUCE_SCATTER', 'BROADCAST', 'REDUCE') AND comm_id_hash <> 0
        GROUP BY comm_id_hash, seq, op)""").fetchone()[0]
    retx = con.execute("SELECT count(*) FROM tcp_events WHERE event = 'tcp_retransmit_skb'").fetchone()[0]
    con.close()
    got: dict = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "collective":
            got[e["args"]["rank"]] = got.get(e["args"]["rank"], 0) + 1
    assert got == want and len(got) == 4 and all(n >= flow["steps"][r] for r, n in got.items())
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) == sum(e["ph"] == "f" for e in doc["traceEvents"]) == links
    assert links > 0 and retx > 0
    assert sum(e["ph"] == "i" and e["name"] == "tcp_retransmit_skb" for e in doc["traceEvents"]) == retx
    with capsys.disabled():
        print(f"\n  Perfetto timeline of the lossy-link lab run: {TIMELINE} (open it at https://ui.perfetto.dev)")


# ---- MCP ----------------------------------------------------------------------------------

def test_the_mcp_client_lists_the_tools_and_calls_each_one_on_the_lab_session(flow):
    pytest.importorskip("mcp", reason="the MCP SDK is not installed: pip install -e '.[mcp]'")
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client

    root = flow["out"] / "operator"
    session = flow["artifact"].relative_to(root).as_posix()
    params = StdioServerParameters(command=sys.executable, args=["-m", "ingero", "mcp", "--root", str(root)],
                                   cwd=str(REPO), env=dict(os.environ))

    async def go():
        async with stdio_client(params) as (r, w):
            async with ClientSession(r, w) as s:
                await s.initialize()
                tools = {t.name for t in (await s.list_tools()).tools}
                calls = {"list_sessions": {}, "straggler_report": {"session": session},
                         "rank_detail": {"session": session, "rank": flow["victim"]}, "describe_tables": {},
                         "query": {"session": session, "sql": "SELECT COUNT(*) FROM tcp_events "
                                                              "WHERE event = 'tcp_retransmit_skb'"}}
                got = {}
                for name, args in calls.items():
                    res = await s.call_tool(name, args)
                    assert not res.is_error, (name, res.content[0].text)
                    got[name] = json.loads(res.content[0].text)
                return tools, got

    tools, got = anyio.run(go)
    assert tools == set(got)
    assert session in {s["session"] for s in got["list_sessions"]["sessions"]}
    rep = _report(flow["artifact"])
    assert got["straggler_report"]["straggler"] == rep["straggler"]
    assert got["straggler_report"]["retransmits"] == rep["retransmits"] == got["query"]["rows"][0][0]
    assert got["rank_detail"]["rank"] == flow["victim"] and got["rank_detail"]["node"] == flow["victim_node"]
    assert got["rank_detail"]["per_op"]["ALL_REDUCE"]["calls"] == flow["steps"][flow["victim"]]
