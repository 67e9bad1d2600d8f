"""The agent's HTTP API without root: auth, validation, sessions on disk, segments, TLS.

Starting a real tracer needs root and eBPF (tests/cluster does that); here a
small Python program takes the tracer's place where a process must run: it
honours --ready-file and exits 0 on SIGINT, as `ingero trace` does.
"""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import sys
import threading
import time

import pytest

from ingero.store import SegmentWriter
from ingero_agent.api import (ApiError, Plan, Session, SessionManager, check_segment, check_session_id,
                              parse_plan)
from ingero_agent.server import make_server, parse_listen

TOKEN = "t0k3n-for-tests-0123456789abcdef"
FAKE_TRACER = r"""
import json, signal, sys, time, pathlib
argv = sys.argv[1:]
ready = pathlib.Path(argv[argv.index("--ready-file") + 1])
pods = pathlib.Path(argv[argv.index("--pods") + 1])
pathlib.Path(argv[argv.index("--segments") + 1]).mkdir(parents=True, exist_ok=True)
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
def hup(*_):   # what the real tracer does: re-read the pods file
    with open(ready.with_name("hup"), "a") as f:
        f.write(f"{len(json.loads(pods.read_text())['pods'])}\n")
signal.signal(signal.SIGHUP, hup)
ready.touch()
time.sleep(120)
"""


def pods(n=1, node="n1"):
    return [{"name": f"w-{i}", "namespace": "default", "uid": f"uid-{i}", "node": node,
             "containers": [{"name": "trainer", "id": f"containerd://{i:064x}"}], "ips": ["10.0.0.1"]}
            for i in range(n)]


@pytest.fixture
def agent(tmp_path):
    script = tmp_path / "tracer.py"
    script.write_text(FAKE_TRACER)
    mgr = SessionManager(tmp_path / "data", "n1", trace_cmd=[sys.executable, str(script)], stop_timeout_s=10)
    srv = make_server(mgr, ("127.0.0.1", 0), TOKEN.encode(), quiet=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, mgr
    srv.shutdown()
    mgr.shutdown()
    srv.server_close()


def call(srv, method, path, body=None, token=TOKEN, raw=False):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = json.dumps(body).encode() if body is not None else None
    if data is not None:
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, (payload if raw else json.loads(payload or b"{}"))


def test_every_endpoint_but_healthz_answers_401_without_the_right_token(agent):
    srv, _ = agent
    assert call(srv, "GET", "/healthz", token=None)[0] == 200
    for method, path in [("GET", "/v1/time"), ("POST", "/v1/sessions"), ("GET", "/v1/sessions/s1"),
                         ("POST", "/v1/sessions/s1/stop"), ("GET", "/v1/sessions/s1/segments"),
                         ("GET", "/v1/sessions/s1/segments/nccl_events/a.parquet"),
                         ("DELETE", "/v1/sessions/s1")]:
        for token in (None, "wrong-token-of-some-length", TOKEN + "x"):
            status, doc = call(srv, method, path, {} if method == "POST" else None, token=token)
            assert status == 401, (method, path, token)
            assert "token" in doc["error"]


def test_time_endpoint_returns_wall_and_monotonic_nanoseconds(agent):
    import time
    srv, _ = agent
    before = time.time_ns()
    status, doc = call(srv, "GET", "/v1/time")
    assert status == 200 and before <= doc["wall_ns"] <= time.time_ns() and doc["mono_ns"] > 0


@pytest.mark.parametrize("sid", ["../etc", "a/b", "..", ".hidden", "", "x" * 129, "a..b", "a b"])
def test_session_ids_that_could_leave_the_data_dir_are_rejected(sid):
    with pytest.raises(ApiError) as e:
        check_session_id(sid)
    assert e.value.status == 400


@pytest.mark.parametrize("table,name,status", [
    ("nccl_events", "../../x.parquet", 400), ("nccl_events", ".x.parquet.tmp-1", 400),
    ("nccl_events", "a.txt", 400), ("passwd", "a.parquet", 404), ("nccl_events", "a..parquet", 400)])
def test_segment_names_are_validated_strictly(table, name, status):
    with pytest.raises(ApiError) as e:
        check_segment(table, name)
    assert e.value.status == status


def test_traversal_in_urls_gets_no_file_outside_the_data_dir(agent, tmp_path):
    srv, mgr = agent
    (tmp_path / "secret.parquet").write_text("top secret")
    _write_session(mgr, "s1")
    for path in ["/v1/sessions/s1/segments/nccl_events/..%2F..%2F..%2Fsecret.parquet",
                 "/v1/sessions/s1/segments/nccl_events/%2e%2e",
                 "/v1/sessions/..%2Fs1/segments", "/v1/sessions/s1/segments/../../../secret.parquet"]:
        status, body = call(srv, "GET", path, raw=True)
        assert status in (400, 404), path
        assert b"top secret" not in body


@pytest.mark.parametrize("body,needle", [
    ({"pods": []}, "session id"), ({"session_id": "s", "pods": "x"}, "pods must be a list"),
    ({"session_id": "s", "pods": [{"name": "a"}]}, "pods[0]"),
    ({"session_id": "s", "pods": pods(), "probes": ["gpu"]}, "unknown probe"),
    ({"session_id": "s", "pods": pods(), "nccl_lib": "lib.so"}, "absolute"),
    ({"session_id": "s", "pods": pods(), "duration_s": -1}, "duration_s"),
    ({"session_id": "s", "pods": pods(), "rdma_s": 0.01}, "rdma_s must be 0 (off) or from 0.1"),
    ({"session_id": "s", "pods": pods(), "rdma_s": 4000}, "rdma_s"),
    ({"session_id": "s", "pods": [dict(pods()[0], ips=["999.1.1.1"])]}, "not an IP")])
def test_bad_plans_are_refused_with_a_message_naming_the_field(body, needle):
    with pytest.raises(ApiError) as e:
        parse_plan(body)
    assert e.value.status == 400 and needle in str(e.value)


def test_posting_a_plan_starts_once_and_is_idempotent_and_stop_is_idempotent(agent):
    srv, mgr = agent
    plan = {"session_id": "s1", "pods": pods(2), "probes": ["nccl", "tcp"]}
    status, doc = call(srv, "POST", "/v1/sessions", plan)
    assert status == 201 and doc["pods"] == 2 and doc["probes"] == ["nccl", "tcp"]
    pid = mgr.sessions["s1"].proc.pid
    _wait_state(srv, "s1", "running")
    status, doc = call(srv, "POST", "/v1/sessions", plan)
    assert status == 200 and mgr.sessions["s1"].proc.pid == pid and doc["starts"] == 1
    pods_file = json.loads((mgr.root / "s1" / "pods.json").read_text())
    assert pods_file["node"] == "n1" and [p["uid"] for p in pods_file["pods"]] == ["uid-0", "uid-1"]
    for _ in range(2):
        status, doc = call(srv, "POST", "/v1/sessions/s1/stop", {})
        assert status == 200 and doc["state"] == "stopped"
    assert call(srv, "GET", "/v1/sessions/nope")[0] == 404


DETACHING_TRACER = r"""
import signal, sys, time, pathlib
argv = sys.argv[1:]
ready, done = (pathlib.Path(argv[argv.index(f) + 1]) for f in ("--ready-file", "--done-file"))
stopping = []
signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
ready.touch()
while not stopping:
    time.sleep(0.01)
done.touch()      # the last segments are on disk; detaching the probes takes seconds more
time.sleep(30)
"""


def test_a_stop_or_delete_after_a_stop_does_not_wait_for_the_tracer_to_detach(tmp_path):
    # The operator deletes a session it has gathered (a stop, then the folder): that DELETE
    # must not wait for the tracer to detach its probes, nor hold the agent's exit on it.
    script = tmp_path / "tracer.py"
    script.write_text(DETACHING_TRACER)
    mgr = SessionManager(tmp_path / "data", "n1", trace_cmd=[sys.executable, str(script)], stop_timeout_s=20)
    try:
        mgr.start(parse_plan({"session_id": "s1", "pods": pods(1)}))
        proc = mgr.sessions["s1"].proc
        deadline = time.monotonic() + 10
        while mgr.info(mgr.sessions["s1"])["state"] != "running" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mgr.stop("s1")["state"] == "stopped"
        assert mgr.stop("s1")["state"] == "stopped"      # idempotent, and at once
        mgr.delete("s1")
        assert proc.poll() is None, "stop/delete waited for the detaching tracer to exit"
        assert not (mgr.root / "s1").exists() and "s1" not in mgr.sessions
        mgr.shutdown()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_new_pod_in_the_plan_goes_to_the_running_tracer_without_a_restart(agent):
    srv, mgr = agent
    call(srv, "POST", "/v1/sessions", {"session_id": "s1", "pods": pods(1)})
    _wait_state(srv, "s1", "running")
    first = mgr.sessions["s1"].proc
    status, doc = call(srv, "POST", "/v1/sessions", {"session_id": "s1", "pods": pods(2)})
    assert status == 200 and doc["starts"] == 1 and doc["replans"] == 1 and doc["pods"] == 2
    hup = mgr.root / "s1" / "hup"
    deadline = time.monotonic() + 10
    while not (hup.exists() and hup.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hup.read_text() == "2\n" and first.poll() is None     # it read the new pods file
    assert json.loads((mgr.root / "s1" / "plan.json").read_text())["pods"] == pods(2)


def test_the_rdma_counters_period_of_the_plan_reaches_the_tracer_and_a_new_one_restarts_it(agent):
    srv, mgr = agent
    call(srv, "POST", "/v1/sessions", {"session_id": "s1", "pods": pods(1), "rdma_s": 0.5})
    _wait_state(srv, "s1", "running")
    argv = mgr._argv(mgr.sessions["s1"])
    assert argv[argv.index("--rdma-seconds") + 1] == "0.5"
    status, doc = call(srv, "POST", "/v1/sessions", {"session_id": "s1", "pods": pods(1), "rdma_s": 0})
    assert status == 200 and doc["starts"] == 2
    argv = mgr._argv(mgr.sessions["s1"])
    assert argv[argv.index("--rdma-seconds") + 1] == "0.0"


def test_other_probes_in_the_plan_restart_the_tracer_on_the_same_segments(agent):
    srv, mgr = agent
    call(srv, "POST", "/v1/sessions", {"session_id": "s1", "pods": pods(1)})
    _wait_state(srv, "s1", "running")
    first = mgr.sessions["s1"].proc
    status, doc = call(srv, "POST", "/v1/sessions", {"session_id": "s1", "pods": pods(1), "probes": ["nccl"]})
    assert status == 200 and doc["starts"] == 2 and first.poll() is not None
    assert mgr._argv(mgr.sessions["s1"])[mgr._argv(mgr.sessions["s1"]).index("--segments") + 1] == \
        str(mgr.root / "s1" / "segments")


def test_a_restarted_agent_reports_known_sessions_as_interrupted_and_resumes_on_post(tmp_path):
    script = tmp_path / "tracer.py"
    script.write_text(FAKE_TRACER)
    cmd = [sys.executable, str(script)]
    mgr = SessionManager(tmp_path / "data", "n1", trace_cmd=cmd)
    mgr.start(parse_plan({"session_id": "s1", "pods": pods(1)}))
    mgr.shutdown()                               # the agent goes away without a stop
    again = SessionManager(tmp_path / "data", "n1", trace_cmd=cmd)
    assert again.info(again.get("s1"))["state"] == "interrupted"
    status, info = again.start(parse_plan({"session_id": "s1", "pods": pods(1)}))
    assert status == 200 and info["state"] in ("starting", "running")
    again.stop("s1")
    third = SessionManager(tmp_path / "data", "n1", trace_cmd=cmd)
    assert third.info(third.get("s1"))["state"] == "stopped"


def test_segments_are_listed_since_a_cursor_counted_from_metadata_and_downloaded(agent):
    srv, mgr = agent
    w = _write_session(mgr, "s1")
    status, doc = call(srv, "GET", "/v1/sessions/s1")
    assert status == 200 and doc["state"] == "interrupted" and doc["events"] == 5
    status, listing = call(srv, "GET", "/v1/sessions/s1/segments")
    names = {(e["table"], e["name"]) for e in listing["segments"]}
    assert ("nccl_events", "n1__s1__000000.parquet") in names and ("nodes", "n1__s1.parquet") in names
    status, again = call(srv, "GET", f"/v1/sessions/s1/segments?since={listing['cursor']}")
    assert again["segments"] == []
    entry = next(e for e in listing["segments"] if e["table"] == "nccl_events")
    status, body = call(srv, "GET", f"/v1/sessions/s1/segments/nccl_events/{entry['name']}", raw=True)
    assert status == 200 and len(body) == entry["size"] and body[:4] == b"PAR1"
    assert w.counts["nccl_events"] == 5


def test_a_session_counts_the_lost_events_of_every_ring_the_profiler_plugin_s_too(agent):
    _, mgr = agent
    w = _write_session(mgr, "s1")
    w.put_rows("nodes", [{"lost_nccl": 1, "lost_tcp": 0, "lost_sched": 2, "lost_nccl_profiler": 4}])
    w.flush()
    assert mgr.info(mgr.get("s1"))["lost"] == 7


def test_delete_removes_the_session_folder_and_nothing_else(agent, tmp_path):
    srv, mgr = agent
    _write_session(mgr, "s1")
    _write_session(mgr, "s2")
    assert call(srv, "DELETE", "/v1/sessions/s1")[0] == 200
    assert not (mgr.root / "s1").exists() and (mgr.root / "s2" / "plan.json").exists()
    assert call(srv, "GET", "/v1/sessions/s1")[0] == 404


def test_tls_serves_https_with_the_given_certificate(tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    mgr = SessionManager(tmp_path / "data", "n1")
    srv = make_server(mgr, ("127.0.0.1", 0), TOKEN.encode(), tls=(cert, key), quiet=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", srv.server_address[1], context=ctx, timeout=10)
        conn.request("GET", "/v1/time", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_listen_addresses_are_parsed_or_refused_with_the_fix():
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:80") == ("::1", 80)
    from ingero.errors import IngeroError
    with pytest.raises(IngeroError, match="HOST:PORT"):
        parse_listen("9464x")


def _write_session(mgr: SessionManager, sid: str) -> SegmentWriter:
    d = mgr.root / sid
    d.mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps({"session_id": sid, "pods": pods(1)}))
    w = SegmentWriter(d / "segments", "n1", sid)
    w.append("nccl_events", {"timestamp_ns": [1, 2, 3, 4, 5], "op": ["ALL_REDUCE"] * 5, "pid": [7] * 5})
    w.put_rows("nodes", [{"lost_nccl": 0, "lost_tcp": 0, "lost_sched": 0}])
    w.flush()
    mgr.sessions[sid] = Session(sid, d, Plan(sid, pods(1)))   # as found on disk after a restart
    return w


def _wait_state(srv, sid, state, timeout_s=10.0):
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if call(srv, "GET", f"/v1/sessions/{sid}")[1].get("state") == state:
            return
        time.sleep(0.05)
    raise AssertionError(f"session {sid} never reached {state}")


def test_data_max_bytes_deletes_the_session_stopped_longest_ago_never_a_running_one(tmp_path):
    script = tmp_path / "tracer.py"
    script.write_text(FAKE_TRACER)
    mgr = SessionManager(tmp_path / "data", "n1", trace_cmd=[sys.executable, str(script)], stop_timeout_s=10,
                         max_bytes=250_000)
    try:
        for sid in ("old", "mid"):
            mgr.start(parse_plan({"session_id": sid, "pods": pods(1)}))
            (mgr.root / sid / "segments" / "blob").parent.mkdir(parents=True, exist_ok=True)
            (mgr.root / sid / "segments" / "blob").write_bytes(b"x" * 100_000)
            mgr.stop(sid)
            time.sleep(0.05)        # stop times in order
        mgr.start(parse_plan({"session_id": "live", "pods": pods(1)}))
        (mgr.root / "live" / "segments").mkdir(parents=True, exist_ok=True)
        (mgr.root / "live" / "segments" / "blob").write_bytes(b"x" * 100_000)
        # 300 kB > 250 kB: the next start or stop deletes "old" (stopped first), not "live"
        mgr.start(parse_plan({"session_id": "new", "pods": pods(1)}))
        assert not (mgr.root / "old").exists() and "old" not in mgr.sessions
        assert (mgr.root / "mid").is_dir() and (mgr.root / "live").is_dir()
        # over the cap with only tracing sessions left to delete: nothing of theirs goes
        (mgr.root / "live" / "segments" / "blob2").write_bytes(b"x" * 300_000)
        assert mgr.cap() == ["mid"] and (mgr.root / "live").is_dir() and (mgr.root / "new").is_dir()
        with pytest.raises(ApiError):
            mgr.get("mid")
    finally:
        mgr.shutdown()


def test_the_agent_refuses_a_negative_data_cap_in_one_line(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    out = subprocess.run([sys.executable, "-m", "ingero", "agent", "serve", "--node", "n1", "--data-dir",
                          str(tmp_path / "d"), "--token-file", str(token), "--data-max-bytes", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and out.stderr.strip().splitlines() == \
        ["ingero: --data-max-bytes must be >= 0 (0: no cap)"], out.stderr
