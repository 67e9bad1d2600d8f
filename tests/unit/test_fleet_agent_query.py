"""The agent's POST /v1/query: token, engine-level read-only, bounded, scoped to segments; mTLS."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import threading
import time

import pytest

from ingero import readonly_sql
from ingero.errors import IngeroError
from ingero.fleet import Tls, fan_out
from ingero.fleet_targets import Target
from tests.unit.trace_fixture import SESSION, TOKEN, agent_data
from tests.unit.trace_fixture import serve_agent as serve


@pytest.fixture
def agent(tmp_path):
    root = agent_data(tmp_path / "data", "n1", [0, 1], sessions=(SESSION, "default.other.x"))
    srv, mgr = serve(root, "n1", readonly_sql.Limits(timeout_s=1.0, max_rows=50, max_bytes=20_000))
    yield srv, root
    srv.shutdown()
    srv.server_close()


def post(srv, body, token=TOKEN, ctx=None):
    port = srv.server_address[1]
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=15, context=ctx) if ctx
            else http.client.HTTPConnection("127.0.0.1", port, timeout=15))
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    conn.request("POST", "/v1/query", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    doc = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, doc


def test_a_query_answers_columns_types_and_rows_over_every_session_of_the_agent(agent):
    srv, _ = agent
    status, doc = post(srv, {"sql": "SELECT session_id, count(*) AS n FROM nccl_events GROUP BY ALL ORDER BY 1"})
    assert status == 200 and doc["node"] == "n1" and doc["columns"] == ["session_id", "n"]
    assert doc["types"] == ["VARCHAR", "BIGINT"] and doc["rows"] == [["default.job.abc", 60], ["default.other.x", 60]]
    status, doc = post(srv, {"sql": "SELECT count(*) FROM nccl_events", "session_id": SESSION})
    assert status == 200 and doc["rows"] == [[60]] and doc["sessions"] == [SESSION]


def test_the_query_endpoint_needs_the_token(agent):
    srv, _ = agent
    for token in (None, "wrong-token-of-some-length"):
        status, doc = post(srv, {"sql": "SELECT 1"}, token=token)
        assert status == 401 and "token" in doc["error"]


@pytest.mark.parametrize("sql,words", [
    ("COPY (SELECT 1) TO '{out}/copied.csv'", "COPY statements are not allowed"),
    ("SELECT * FROM read_csv('/etc/passwd')", "file system operations are disabled"),
    ("SELECT * FROM read_text('{data}/sessions/default.job.abc/plan.json')", "file system operations are disabled"),
    ("SELECT * FROM read_parquet('{data}/../*.parquet')", "file system operations are disabled"),
    ("ATTACH '{out}/new.duckdb' AS x", "ATTACH statements are not allowed"),
    ("INSTALL httpfs", "LOAD statements are not allowed"),
    ("LOAD httpfs", "not allowed"),
    ("SET enable_external_access = true", "SET statements are not allowed"),
    ("CREATE TABLE t AS SELECT 1", "CREATE statements are not allowed"),
    ("SELECT 1; SELECT 2", "2 statements given"),
    ("SELEC 1", "does not parse"),
])
def test_writes_and_reads_outside_the_session_data_are_refused(agent, tmp_path, sql, words):
    srv, root = agent
    status, doc = post(srv, {"sql": sql.format(out=tmp_path, data=root)})
    assert status == 400 and words in doc["error"], doc
    assert not (tmp_path / "copied.csv").exists() and not (tmp_path / "new.duckdb").exists()


def test_the_engine_itself_refuses_file_access_even_inside_a_select(tmp_path):
    root = agent_data(tmp_path / "d", "n1", [0])
    con = readonly_sql.open_sandbox([root / "sessions" / SESSION / "segments"])
    try:
        for stmt in (f"COPY (SELECT 1) TO '{tmp_path}/x.csv'", "INSTALL httpfs", "LOAD httpfs",
                     f"ATTACH '{tmp_path}/y.duckdb'", "SELECT * FROM read_csv('/etc/passwd')",
                     "SET enable_external_access = true"):
            with pytest.raises(Exception) as e:
                con.execute(stmt)      # below the statement filter: DuckDB's own locks
            assert any(w in str(e.value) for w in ("disabled", "locked")), (stmt, e.value)
        assert con.execute("SELECT count(*) FROM nccl_events").fetchone()[0] == 30
    finally:
        con.close()
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "y.duckdb").exists()


def test_a_long_query_is_interrupted_at_the_time_bound(agent):
    srv, _ = agent
    t0 = time.monotonic()
    status, doc = post(srv, {"sql": "SELECT count(*) FROM range(100000000000)"})
    assert status == 408 and "interrupted after 1 s" in doc["error"] and time.monotonic() - t0 < 5
    status, doc = post(srv, {"sql": "SELECT count(*) FROM range(100000000000)", "timeout_s": 0.2})
    assert status == 408 and "0.2 s" in doc["error"]


def test_rows_and_bytes_returned_are_capped_and_say_so(agent):
    srv, _ = agent
    status, doc = post(srv, {"sql": "SELECT * FROM range(1000)"})
    assert status == 200 and len(doc["rows"]) == 50 and doc["truncated"] == "rows"
    status, doc = post(srv, {"sql": "SELECT * FROM range(1000)", "max_rows": 5000})   # never widened
    assert len(doc["rows"]) == 50
    status, doc = post(srv, {"sql": "SELECT repeat('x', 1000) FROM range(40)"})
    assert status == 200 and doc["truncated"] == "bytes" and len(json.dumps(doc["rows"])) <= 20_000


def test_an_unknown_session_is_404_and_a_bad_body_is_400(agent):
    srv, _ = agent
    assert post(srv, {"sql": "SELECT 1", "session_id": "nope"})[0] == 404
    assert post(srv, {"sql": "SELECT 1", "session_id": "../x"})[0] == 400
    assert post(srv, {"query": "SELECT 1"})[0] == 400
    assert post(srv, {"sql": "SELECT 1", "max_rows": "many"})[0] == 400


def test_queries_beyond_the_concurrency_slots_are_turned_away(tmp_path):
    root = agent_data(tmp_path / "d", "n1", [0])
    srv, _ = serve(root, "n1", readonly_sql.Limits(timeout_s=1.5), slots=1)
    try:
        first = threading.Thread(target=post, args=(srv, {"sql": "SELECT count(*) FROM range(100000000000)"}))
        first.start()
        time.sleep(0.3)
        status, doc = post(srv, {"sql": "SELECT 1"})
        first.join()
        assert status == 429 and "busy" in doc["error"]
        assert post(srv, {"sql": "SELECT 1"})[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


def _openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def test_with_a_client_ca_only_clients_presenting_a_certificate_it_signed_get_in(tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed (needed to make test certificates)")
    d = tmp_path
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for name in ("ca", "rogue"):
        _openssl("req", "-x509", *key, "-keyout", str(d / f"{name}.key"), "-out",
                 str(d / f"{name}.pem"), "-days", "1", "-subj", f"/CN={name}")
    for name, ca in (("server", "ca"), ("client", "ca"), ("badclient", "rogue")):
        _openssl("req", *key, "-keyout", str(d / f"{name}.key"), "-out",
                 str(d / f"{name}.csr"), "-subj", "/CN=127.0.0.1")
        ext = d / "ext.cnf"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:ingero-agent.ingero-system.svc\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.pem"), "-CAkey",
                 str(d / f"{ca}.key"), "-CAcreateserial", "-out", str(d / f"{name}.pem"), "-days", "1",
                 "-extfile", str(ext))
    root = agent_data(tmp_path / "data", "n1", [0])
    srv, _ = serve(root, "n1", tls=(d / "server.pem", d / "server.key"), client_ca=d / "ca.pem")
    try:
        def ctx(cert=None):
            c = ssl.create_default_context(cafile=str(d / "ca.pem"))
            if cert:
                c.load_cert_chain(str(d / f"{cert}.pem"), str(d / f"{cert}.key"))
            return c

        status, doc = post(srv, {"sql": "SELECT 42"}, ctx=ctx("client"))
        assert status == 200 and doc["rows"] == [[42]]
        for bad in (None, "badclient"):
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                post(srv, {"sql": "SELECT 42"}, ctx=ctx(bad))
        # `ingero fleet` over the same mutual TLS, checking the name the certificate carries
        target = Target("n1", "127.0.0.1", srv.server_address[1])
        tls = Tls(str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key"), "ingero-agent.ingero-system.svc")
        assert fan_out([target], TOKEN, "SELECT 42 AS x", tls=tls).rows == [["n1", 42]]
        for bad in (Tls(str(d / "ca.pem"), None, None, None),
                    Tls(str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key"), "other.example")):
            with pytest.raises(IngeroError, match="n1: (TLS handshake|unreachable)"):
                fan_out([target], TOKEN, "SELECT 42 AS x", tls=bad)
    finally:
        srv.shutdown()
        srv.server_close()
