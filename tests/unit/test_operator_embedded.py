"""The embedded API server: admission by the CRD schema, metadata, status subresource, lists,
and the service proxy."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ingero_operator.embedded import EmbeddedCluster, merge_apply, merge_diff

REPO = Path(__file__).resolve().parents[2]
TRS = "/apis/ingero.io/v1alpha1/namespaces/default/tracesessions"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EmbeddedCluster(REPO / "crds" / "tracesession.yaml", tmp_path_factory.mktemp("api")).start()
    yield c
    c.stop()


def session(name, **spec):
    return {"apiVersion": "ingero.io/v1alpha1", "kind": "TraceSession",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


@pytest.mark.parametrize("name,spec,field,words", [
    ("p1", {"selector": {"matchLabels": {"a": "b"}}, "probes": ["gpu"]}, "spec.probes[0]", "Unsupported value"),
    ("p2", {"selector": {"matchLabels": {"a": "b"}}, "durationSeconds": -1}, "spec.durationSeconds",
     "greater than or equal to 1"),
    ("p3", {"probes": ["nccl"]}, "spec.selector", "Required value"),
    ("p4", {"selector": {"matchLabels": {}}}, "spec.selector.matchLabels", "at least 1"),
    ("p5", {"selector": {"matchLabels": {"a": "b"}}, "thresholds": {"slowCollectiveMs": -2}},
     "spec.thresholds.slowCollectiveMs", "greater than or equal to 0"),
    ("p6", {"selector": {"matchLabels": {"a": "b"}}, "durationSeconds": 2 ** 63 - 1}, "spec.durationSeconds",
     "less than or equal to 2592000")])
def test_a_trace_session_violating_the_crd_schema_is_rejected_with_422_naming_the_field(cluster, name, spec,
                                                                                       field, words):
    code, doc = cluster.request("POST", TRS, session(name, **spec))
    assert code == 422 and doc["reason"] == "Invalid"
    assert doc["details"]["causes"][0]["field"] == field and words in doc["message"]
    assert f'TraceSession.ingero.io "{name}" is invalid' in doc["message"]
    assert cluster.get(f"{TRS}/{name}") is None


def test_defaults_and_metadata_are_filled_on_create(cluster):
    obj = cluster.create(TRS, session("ok1", selector={"matchLabels": {"a": "b"}}))
    meta = obj["metadata"]
    assert obj["spec"]["probes"] == ["nccl", "tcp", "sched"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > 0


def test_status_writes_touch_only_status_and_spec_writes_bump_generation(cluster):
    cluster.create(TRS, session("ok2", selector={"matchLabels": {"a": "b"}}))
    after = cluster.patch(f"{TRS}/ok2/status", {"status": {"phase": "Running"}, "spec": {"durationSeconds": 9}})
    assert after["status"]["phase"] == "Running" and "durationSeconds" not in after["spec"]
    after = cluster.patch(f"{TRS}/ok2", {"spec": {"durationSeconds": 30}, "status": {"phase": "Failed"}})
    assert after["metadata"]["generation"] == 2 and after["status"]["phase"] == "Running"
    code, doc = cluster.request("PATCH", f"{TRS}/ok2", {"spec": {"probes": ["x"]}}, "application/merge-patch+json")
    assert code == 422 and "spec.probes[0]" in doc["message"]


def test_json_patch_with_a_stale_resource_version_test_is_refused(cluster):
    obj = cluster.create(TRS, session("ok3", selector={"matchLabels": {"a": "b"}}))
    rv = obj["metadata"]["resourceVersion"]
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
           {"op": "add", "path": "/metadata/finalizers", "value": ["f"]}]
    code, doc = cluster.request("PATCH", f"{TRS}/ok3", ops, "application/json-patch+json")
    assert code == 200 and doc["metadata"]["finalizers"] == ["f"]
    code, _ = cluster.request("PATCH", f"{TRS}/ok3", ops, "application/json-patch+json")
    assert code == 422


def test_pod_lists_honour_label_selectors_and_carry_a_kind(cluster):
    for i, job in enumerate(["a", "a", "b"]):
        cluster.create("/api/v1/namespaces/default/pods",
                       {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}", "labels": {"job": job}}})
    code, doc = cluster.request("GET", "/api/v1/namespaces/default/pods?labelSelector=job%3Da")
    assert code == 200 and doc["kind"] == "PodList" and [p["metadata"]["name"] for p in doc["items"]] == ["p0", "p1"]


def test_kubectl_shows_the_printer_columns_and_the_schema_error(cluster, tmp_path):
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed")
    env = {"KUBECONFIG": str(cluster.kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "KUBECACHEDIR": str(tmp_path / "kube-cache")}
    cluster.patch(f"{TRS}/ok1/status", {"status": {"phase": "Completed", "ranks": 4, "retransmits": 12,
                                                   "slowdown": "7.5%",
                                                   "straggler": {"who": "w-3", "pod": "w-3", "cause": "network"},
                                                   "verdict": {"kind": "straggler", "who": "w-3"}}})
    out = subprocess.run(["kubectl", "get", "trs", "ok1"], env=env, capture_output=True, text=True, timeout=30)
    lines = [ln.split() for ln in out.stdout.splitlines()]
    assert lines[0] == ["NAME", "PHASE", "RANKS", "STRAGGLER", "CAUSE", "SLOWDOWN", "RETRANSMITS", "AGE"]
    assert lines[1][:7] == ["ok1", "Completed", "4", "w-3", "network", "7.5%", "12"]
    # a trace that cannot support a verdict: the column says so instead of staying empty
    cluster.patch(f"{TRS}/ok1/status", {"status": {"straggler": None, "slowdown": None, "verdict": {
        "kind": "cannot-judge", "who": "cannot judge", "reason": "no NCCL collective or point-to-point call"}}})
    out = subprocess.run(["kubectl", "get", "trs", "ok1"], env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.splitlines()[1].split()[:5] == ["ok1", "Completed", "4", "cannot", "judge"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: ingero.io/v1alpha1\nkind: TraceSession\nmetadata: {name: bad}\n"
                   "spec: {selector: {matchLabels: {a: b}}, probes: [gpu]}\n")
    out = subprocess.run(["kubectl", "apply", "--validate=false", "-f", str(bad)], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and 'spec.probes[0]: Unsupported value: "gpu"' in out.stderr


def test_merge_diff_turns_one_object_into_another():
    old = {"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2]}
    new = {"a": 1, "b": {"c": 5}, "l": [2], "e": "x"}
    assert merge_apply(old, merge_diff(old, new)) == new


# ---- the service proxy ------------------------------------------------------------------------

class Echo(http.server.BaseHTTPRequestHandler):
    """A backend that says what it got (path, whether credentials came along), or streams 4 MiB."""

    def do_GET(self):
        if self.path.startswith("/big"):
            body = bytes(range(256)) * (4 << 12)
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(0, len(body), 1 << 16):
                self.wfile.write(body[i:i + (1 << 16)])
            return
        body = json.dumps({"path": self.path, "authorization": self.headers.get("Authorization"),
                           "tls": isinstance(self.connection, ssl.SSLSocket)}).encode()
        self.send_response(404 if self.path.startswith("/missing") else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def backend(tls_dir: Path | None = None) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    if tls_dir is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls_dir / "tls.crt", tls_dir / "tls.key")
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def proxied(cluster, ident: str, path: str, ns: str = "default") -> tuple[int, bytes, dict]:
    req = urllib.request.Request(f"{cluster.url}/api/v1/namespaces/{ns}/services/{ident}/proxy{path}",
                                 headers={"Authorization": "Bearer the-users-token"})
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture(scope="module")
def echo(cluster, tmp_path_factory):
    """Service `echo` in default: port `web` (80) to the pod's container port `http`, port `tls`
    (443) to a TLS backend by number, both on the Running pod its selector matches."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed (makes the TLS backend's certificate)")
    d = tmp_path_factory.mktemp("echo-tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=echo",
                    "-keyout", "tls.key", "-out", "tls.crt"], cwd=d, check=True, capture_output=True)
    plain, tls = backend(), backend(d)
    cluster.create("/api/v1/namespaces/default/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo"},
        "spec": {"selector": {"app": "echo"}, "ports": [
            {"name": "web", "port": 80, "targetPort": "http"},
            {"name": "tls", "port": 443, "targetPort": tls.server_address[1]}]}})
    for name, phase in (("echo-0", "Running"), ("echo-old", "Succeeded")):
        cluster.create("/api/v1/namespaces/default/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "echo"}},
            "spec": {"containers": [{"name": "echo", "ports": [{"name": "http",
                                                                "containerPort": plain.server_address[1]}]}]},
            "status": {"phase": phase, "podIP": "127.0.0.1"}})
    yield plain, tls
    for srv in (plain, tls):
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("ident", ["echo:web", "echo:80", "http:echo:web"])
def test_the_service_proxy_reaches_the_port_by_name_or_number_without_the_callers_credentials(cluster, echo, ident):
    code, body, _ = proxied(cluster, ident, "/a/b%2Fc?x=1&y=%2F")
    assert code == 200 and json.loads(body) == {"path": "/a/b%2Fc?x=1&y=%2F", "authorization": None, "tls": False}


def test_an_https_prefix_reaches_a_tls_backend_unverified_as_kube_apiserver_does(cluster, echo):
    code, body, _ = proxied(cluster, "https:echo:tls", "/x")
    assert code == 200 and json.loads(body)["tls"] is True
    assert proxied(cluster, "https:echo:443", "/y")[0] == 200


def test_the_backends_status_headers_and_a_large_body_come_back_as_they_are(cluster, echo):
    code, body, headers = proxied(cluster, "echo:web", "/missing")
    assert code == 404 and headers["Content-Type"] == "application/json" and json.loads(body)["path"] == "/missing"
    code, body, _ = proxied(cluster, "echo:web", "/big")
    assert code == 200 and body == bytes(range(256)) * (4 << 12)


def test_proxy_errors_are_the_api_servers(cluster, echo):
    code, body, _ = proxied(cluster, "nope:web", "/")
    assert (code, json.loads(body)["message"]) == (404, 'services "nope" not found')
    code, body, _ = proxied(cluster, "echo", "/")            # the ports are named: a name is required
    assert (code, json.loads(body)["reason"]) == (503, "ServiceUnavailable")
    assert json.loads(body)["message"] == 'no endpoints available for service "echo"'
    code, body, _ = proxied(cluster, "echo:8080", "/")
    assert (code, json.loads(body)["message"]) == (503, 'no service port 8080 found for service "echo"')
    assert proxied(cluster, "ftp:echo:web", "/")[0] == 400


def test_an_endpoints_object_is_used_instead_of_the_selector(cluster, echo):
    plain, _ = echo
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))           # bound, never listening: connection refused
    try:
        cluster.create("/api/v1/namespaces/default/endpoints", {
            "apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "echo"},
            "subsets": [{"addresses": [{"ip": "127.0.0.1"}],
                         "ports": [{"name": "web", "port": dead.getsockname()[1]}]}]})
        code, body, _ = proxied(cluster, "echo:web", "/")
        assert code == 503 and json.loads(body)["message"].startswith(
            f"error trying to reach service: dial tcp 127.0.0.1:{dead.getsockname()[1]}: ")
    finally:
        cluster.request("DELETE", "/api/v1/namespaces/default/endpoints/echo")
        dead.close()
    assert proxied(cluster, "echo:web", "/")[0] == 200       # the selector again
