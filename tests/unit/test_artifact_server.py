"""The operator's artifact server on its own: what it serves, and that nothing else can be named.

Requests go over a raw socket (http.client), so paths reach the server as written: no client
or proxy cleans `..` or decodes `%2F` first (tests/unit/test_kubectl_plugin.py tries the same
through kubectl and the API server's proxy).
"""

from __future__ import annotations

import http.client
import io
import json
import os
import tarfile

import pytest

pytest.importorskip("aiohttp", reason="the operator's dependencies are not installed")

from ingero_operator import artifact_server as art  # noqa: E402

SECRET = b"the operator's own secret"


def make_artifact(folder, key: str | None = None) -> str:
    (folder / "work" / "nodes" / "node-a" / "nccl_events").mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({"folder": folder.name}))
    (folder / "trace.duckdb").write_bytes(os.urandom(300_000))
    (folder / "work" / "live.duckdb").write_bytes(b"live")
    (folder / "work" / "nodes" / "node-a" / "nccl_events" / "node-a__s__000001.parquet").write_bytes(b"PAR1seg")
    if key is None:
        return art.write_key(folder)
    (folder / art.KEY_FILE).write_text(key)
    return key


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("artifacts")
    root = tmp / "artifacts"
    (tmp / "secret.txt").write_bytes(SECRET)
    (root / "default").mkdir(parents=True)
    key = make_artifact(root / "default" / "k-1234abcd")
    other = make_artifact(root / "default" / "k-b-abcdef12")          # a session named k-b
    outside = tmp / "elsewhere"
    outside.mkdir()
    evil = make_artifact(outside)
    (root / "default" / "evil-12345678").symlink_to(outside)            # a folder that leads out
    srv = art.serve(root, 0, "127.0.0.1")
    return srv, root, {"k": key, "k-b": other, "evil": evil}


def get(srv, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)     # sent exactly as written
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_report_trace_and_folder_are_served_for_the_right_key(served):
    srv, root, keys = served
    src = root / "default" / "k-1234abcd"
    code, body = get(srv, f"/v1/artifacts/default/k/report.json?key={keys['k']}")
    assert (code, json.loads(body)) == (200, {"folder": "k-1234abcd"})
    code, body = get(srv, f"/v1/artifacts/default/k/trace.duckdb?key={keys['k']}")
    assert code == 200 and body == (src / "trace.duckdb").read_bytes()
    code, body = get(srv, f"/v1/artifacts/default/k/artifact.tar?key={keys['k']}")
    assert code == 200
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        got = {m.name: (m.uid, m.mode, tar.extractfile(m).read()) for m in tar}
    seg = "work/nodes/node-a/nccl_events/node-a__s__000001.parquet"
    assert sorted(got) == sorted(["trace.duckdb", "report.json", seg])     # never the key or live.duckdb
    assert all(got[n] == (0, 0o644, (src / n).read_bytes()) for n in got)
    assert get(srv, f"/v1/artifacts/default/k/artifact.tar?key={keys['k']}", "HEAD")[0] == 200


def test_a_wrong_missing_or_malformed_key_reads_nothing(served):
    srv, _, keys = served
    assert get(srv, "/v1/artifacts/default/k/report.json")[0] == 400
    assert get(srv, f"/v1/artifacts/default/k/report.json?key={keys['k-b']}")[0] == 404
    assert get(srv, f"/v1/artifacts/default/k-b/report.json?key={keys['k']}")[0] == 404   # k's key is not k-b's
    assert get(srv, f"/v1/artifacts/default/k/report.json?key={keys['k']}%2F..%2F..")[0] == 400
    code, body = get(srv, f"/v1/artifacts/default/k-b/report.json?key={keys['k-b']}")
    assert (code, json.loads(body)) == (200, {"folder": "k-b-abcdef12"})


@pytest.mark.parametrize("path", [
    "/v1/artifacts/default/../../secret.txt",
    "/v1/artifacts/default/k/../../../secret.txt?key={k}",
    "/v1/artifacts/..%2F..%2F/secret.txt/report.json?key={k}",
    "/v1/artifacts/default/..%2F..%2Fsecret.txt/report.json?key={k}",
    "/v1/artifacts/default/k/..%2F..%2F..%2Fsecret.txt?key={k}",
    "/v1/artifacts/default/k/artifact.key?key={k}",
    "/v1/artifacts/default/k/work%2Flive.duckdb?key={k}",
    "/v1/artifacts/default/evil/report.json?key={evil}",              # a symlinked folder
    "/v1/artifacts/%2E%2E/k/report.json?key={k}",
    "/v1/artifacts/default/k-1234abcd/report.json?key={k}",           # the folder's own name is no session name
    "//v1/artifacts/default/k/report.json/../../../../secret.txt?key={k}",
])
def test_names_outside_the_artifacts_are_refused(served, path):
    srv, _, keys = served
    code, body = get(srv, path.format(**keys))
    assert code in (400, 404) and SECRET not in body and b"PAR1" not in body, (code, body[:200])


def test_errors_are_kubernetes_status_objects_and_only_get_is_served(served):
    srv, _, keys = served
    code, body = get(srv, "/v1/artifacts/default/nope/report.json?key=" + "x" * 32)
    doc = json.loads(body)
    assert (code, doc["kind"], doc["status"], doc["reason"], doc["code"]) == (404, "Status", "Failure", "NotFound", 404)
    assert doc["message"].startswith("no artifact of TraceSession default/nope with this key")
    assert get(srv, f"/v1/artifacts/default/k/report.json?key={keys['k']}", "POST")[0] == 405
    assert get(srv, f"/v1/artifacts/default/k/report.json?key={keys['k']}", "DELETE")[0] == 405


def test_the_key_is_readable_by_the_owner_only_and_new_each_time(tmp_path):
    a, b = art.write_key(tmp_path), art.write_key(tmp_path)
    assert a != b and art.KEY.fullmatch(a) and (tmp_path / art.KEY_FILE).read_text() == b
    assert (tmp_path / art.KEY_FILE).stat().st_mode & 0o777 == 0o600
