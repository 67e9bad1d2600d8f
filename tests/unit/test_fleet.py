"""`ingero fleet query`: fan-out to real agent servers, partial failures, clock correction, discovery."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ingero.cli import main
from ingero.errors import IngeroError
from ingero.fleet import fan_out
from ingero.fleet_targets import Target, parse_nodes
from tests.unit.trace_fixture import T0, TOKEN, agent_data, serve_agent

SKEW = 2_000_000_000     # node-b's clock runs 2 s ahead
SQL = ("SELECT global_rank AS r, count(*) AS calls, min(timestamp_ns) AS timestamp_ns FROM nccl_events "
       "GROUP BY ALL ORDER BY r")


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    a, _ = serve_agent(agent_data(d / "a", "node-a", [0, 1]), "node-a")
    b, _ = serve_agent(agent_data(d / "b", "node-b", [2, 3], skew_ns=SKEW), "node-b")
    # node-b's clock (what its /v1/time says) is as far ahead as its recorded timestamps
    b.wall_ns = lambda: time.time_ns() + SKEW
    yield {"node-a": a, "node-b": b}
    for s in (a, b):
        s.shutdown()
        s.server_close()


def target(name, srv) -> Target:
    return Target(name, "127.0.0.1", srv.server_address[1])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stub(BaseHTTPRequestHandler):
    """A node that answers the clock but not the query as an agent should (slow, or other columns)."""

    protocol_version = "HTTP/1.1"
    mode = "slow"

    def log_message(self, *a):
        pass

    def _send(self, doc):
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"wall_ns": time.time_ns(), "mono_ns": 0})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.mode == "slow":
            time.sleep(4)
        self._send({"columns": ["r", "calls"], "types": ["INTEGER", "BIGINT"], "rows": [[9, 1]]})


@pytest.fixture
def stub():
    servers = []

    def start(mode: str) -> Target:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), type("S", (Stub,), {"mode": mode}))
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return Target(f"stub-{mode}", "127.0.0.1", srv.server_address[1])

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_one_table_with_node_first_holds_every_agents_rows(agents):
    res = fan_out([target(n, s) for n, s in agents.items()], TOKEN, SQL, timeout_s=5)
    assert res.columns == ["node", "r", "calls", "timestamp_ns"] and not res.warnings
    assert [(r[0], r[1], r[2]) for r in res.rows] == [("node-a", 0, 30), ("node-a", 1, 30),
                                                      ("node-b", 2, 30), ("node-b", 3, 30)]


def test_timestamps_are_moved_onto_one_clock_by_each_nodes_measured_offset(agents):
    res = fan_out([target(n, s) for n, s in agents.items()], TOKEN, SQL, timeout_s=5, show_clock=True)
    assert res.columns[:3] == ["node", "clock_offset_ns", "clock_rtt_ns"]
    off = {r[0]: r[1] for r in res.rows}
    assert abs(off["node-a"]) < 5_000_000 and abs(off["node-b"] - SKEW) < 5_000_000
    first = {r[3]: r[5] for r in res.rows}
    # every rank's first call happened at T0 + 20 ms on the true clock (rank 3: 6 ms late)
    assert all(abs(t - (T0 + 20_000_000 + 6_000_000 * (r == 3))) < 3_000_000 for r, t in first.items()), first


def test_a_stopped_agent_is_left_out_with_a_warning_naming_it_and_why(agents):
    dead = Target("node-c", "127.0.0.1", closed_port())
    res = fan_out([target("node-a", agents["node-a"]), dead], TOKEN, SQL, timeout_s=5)
    assert {r[0] for r in res.rows} == {"node-a"}
    assert res.warnings == [f"node node-c left out: unreachable at 127.0.0.1:{dead.port} (Connection refused)"]


def test_a_slow_agent_is_left_out_once_the_timeout_passes(agents, stub):
    t0 = time.monotonic()
    res = fan_out([target("node-a", agents["node-a"]), stub("slow")], TOKEN, SQL, timeout_s=1)
    assert time.monotonic() - t0 < 3.5
    assert {r[0] for r in res.rows} == {"node-a"}
    assert len(res.warnings) == 1 and res.warnings[0].startswith("node stub-slow left out: slow: no answer")


def test_an_agent_answering_other_columns_is_left_out_naming_them(agents, stub):
    res = fan_out([*(target(n, s) for n, s in agents.items()), stub("columns")], TOKEN, SQL, timeout_s=5)
    assert {r[0] for r in res.rows} == {"node-a", "node-b"}
    assert res.warnings == ["node stub-columns left out: it returned columns ['r', 'calls'] where the other "
                            "nodes returned ['r', 'calls', 'timestamp_ns']"]


def test_a_wrong_token_or_a_refused_query_is_a_per_node_warning_and_all_failing_is_an_error(agents):
    res = fan_out([target("node-a", agents["node-a"])], TOKEN, SQL, timeout_s=5)
    assert res.rows
    with pytest.raises(IngeroError) as e:
        fan_out([target(n, s) for n, s in agents.items()], "not-the-token-at-all", SQL, timeout_s=5)
    assert "node-a: refused the bearer token" in str(e.value) and "node-b: refused" in str(e.value)
    with pytest.raises(IngeroError, match="COPY statements are not allowed"):
        fan_out([target("node-a", agents["node-a"])], TOKEN, "COPY nccl_events TO '/tmp/x.csv'", timeout_s=5)


def test_the_cli_prints_one_table_and_warns_on_stderr_about_the_node_left_out(agents, tmp_path, capsys):
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    nodes = f"node-a=127.0.0.1:{agents['node-a'].server_address[1]},node-x=127.0.0.1:{closed_port()}"
    assert main(["fleet", "query", "SELECT count(*) AS n FROM tcp_events", "--nodes", nodes,
                 "--token-file", str(tok), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert [json.loads(x) for x in out.out.splitlines()] == [{"node": "node-a", "n": 0}]
    assert "warning: node node-x left out: unreachable" in out.err


@pytest.mark.parametrize("argv,words", [
    (["--nodes", "a=localhost"], "is not HOST:PORT"),
    (["--nodes", "a=h:1,a=h:2"], "twice"),
    (["--nodes", "a=h:1", "--timeout", "soon"], "--timeout 'soon' is not a duration"),
])
def test_bad_options_fail_with_one_line_naming_the_fix(argv, words, tmp_path, capsys):
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    assert main(["fleet", "query", "SELECT 1", "--token-file", str(tok), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_node_entries_are_parsed_into_targets_and_names_to_look_up():
    got, names = parse_nodes("gpu-1=10.0.0.7:9464,gpu-2,gpu-3=[fd00::3]:9464")
    assert got == [Target("gpu-1", "10.0.0.7", 9464), Target("gpu-3", "fd00::3", 9464)] and names == ["gpu-2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, agents):
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed (fleet resolves node names through it)")
    from ingero_operator import cluster_objects as objs
    from ingero_operator.embedded import EmbeddedCluster

    repo = Path(__file__).resolve().parents[2]
    c = EmbeddedCluster(repo / "crds" / "tracesession.yaml", tmp_path_factory.mktemp("api")).start()
    c.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/secrets", objs.token_secret(TOKEN))
    for node, srv in agents.items():
        c.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/pods", objs.agent_pod(node, srv.server_address[1]))
    c.create("/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w-3", "namespace": "default",
                                                        "labels": {"job-name": "train"}},
        "spec": {"nodeName": "node-b", "containers": [{"name": "w", "image": "x"}]}, "status": {"phase": "Running"}})
    yield c
    c.stop()


def test_node_names_and_the_token_are_resolved_through_the_cluster_as_the_operator_does(cluster, capsys):
    kc = str(cluster.kubeconfig)
    assert main(["fleet", "query", "SELECT count(*) AS n FROM nccl_events", "--kubeconfig", kc,
                 "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["node,n", "node-a,60", "node-b,60"]
    assert main(["fleet", "query", "SELECT count(*) AS n FROM nccl_events", "--kubeconfig", kc,
                 "--selector", "job-name=train", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["node,n", "node-b,60"]
    assert main(["fleet", "query", "SELECT 1 AS x", "--kubeconfig", kc, "--nodes", "node-a,node-z",
                 "--format", "csv"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["node,x", "node-a,1"] and "node node-z: no ingero agent Pod" in out.err
