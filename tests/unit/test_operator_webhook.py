"""The profiler-plugin admission webhook, as the API server calls it: AdmissionReview v1 over HTTPS.

The real operator (`ingero operator run --webhook-port ...`, a process, kopf's own
WebhookServer) against the embedded API server; a test CA signs the server's
certificate for the webhook Service's DNS name only, and every request verifies it
with that CA and that name, as the API server does with the configuration's caBundle.
"""

from __future__ import annotations

import base64
import copy
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICE_DNS = "ingero-operator-webhook.ingero-system.svc"
PLUGIN_DIR = "/var/lib/ingero/plugin"
PLUGIN = f"{PLUGIN_DIR}/libnccl-profiler-ingero.so"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed (test CA)")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca_and_cert(d: Path, dns: str, ca: str = "ca") -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.crt", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={dns}", "-keyout", "tls.key", "-out", "tls.csr",
            cwd=d)
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:{dns}\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-extfile", "ext.cnf", "-out", "tls.crt", cwd=d)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceConnection(http.client.HTTPSConnection):
    """HTTPS to 127.0.0.1, verifying the certificate for the Service's DNS name (self.host)."""

    def connect(self):
        sock = socket.create_connection(("127.0.0.1", self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def post(port: int, path: str, review: dict, cafile: Path, name: str = SERVICE_DNS) -> tuple[int, dict]:
    ctx = ssl.create_default_context(cafile=str(cafile))
    conn = ServiceConnection(name, port, context=ctx, timeout=30)
    try:
        conn.request("POST", path, json.dumps(review), {"Content-Type": "application/json"})
        r = conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if body.startswith(b"{") else {"text": body.decode(errors="replace")}
    finally:
        conn.close()


def review(pod: dict, namespace: str = "team-a", operation: str = "CREATE") -> dict:
    """An AdmissionReview v1 request as the API server sends it for a pod creation."""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": str(uuid.uuid4()),
                        "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                        "name": pod["metadata"].get("name", ""), "namespace": namespace, "operation": operation,
                        "userInfo": {"username": "system:serviceaccount:kube-system:job-controller",
                                     "groups": ["system:serviceaccounts", "system:authenticated"]},
                        "object": pod, "oldObject": None, "dryRun": False,
                        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}


def pod(name: str, labels: dict | None = None, containers: int = 2, **spec) -> dict:
    cs = [{"name": f"c{i}", "image": "trainer:1", "env": [{"name": "WORLD_SIZE", "value": "4"}]}
          for i in range(containers)]
    cs[-1].pop("env")      # one container without any env, one with
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team-a", "labels": labels or {}},
            "spec": {"containers": cs, **spec}}


def apply_patch(obj: dict, response: dict) -> dict:
    jsonpatch = pytest.importorskip("jsonpatch")
    assert response.get("patchType") == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(obj))


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    for mod in ("kmock", "kopf", "jsonschema"):
        pytest.importorskip(mod, reason=f"{mod} is not installed: pip install -e '.[test]'")
    from ingero_operator.embedded import EmbeddedCluster

    tmp = tmp_path_factory.mktemp("webhook")
    make_ca_and_cert(tmp, SERVICE_DNS)
    cluster = EmbeddedCluster(ROOT / "crds" / "tracesession.yaml", tmp / "api").start()
    port = free_port()
    log = open(tmp / "operator.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingero", "operator", "run", "--standalone", "--namespace", "ingero-system",
         "--artifacts", str(tmp / "artifacts"), "--webhook-port", str(port), "--webhook-address", "127.0.0.1",
         "--webhook-cert", str(tmp / "tls.crt"), "--webhook-key", str(tmp / "tls.key"),
         "--profiler-plugin-dir", PLUGIN_DIR, "--log-level", "debug"],
        cwd=ROOT, env=dict(os.environ, KUBECONFIG=str(cluster.kubeconfig)), stdout=log, stderr=subprocess.STDOUT)

    def operator_log() -> str:
        return (tmp / "operator.log").read_text(errors="replace")[-4000:]

    try:
        deadline = time.monotonic() + 60
        while True:    # kopf opens the server once it has scanned the API's resources
            assert proc.poll() is None, f"the operator exited:\n{operator_log()}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"the webhook never listened:\n{operator_log()}"
                time.sleep(0.2)
        yield {"port": port, "ca": tmp / "ca.crt", "tmp": tmp, "log": operator_log}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        cluster.stop()


def admit(webhook, path: str, obj: dict) -> dict:
    req = review(obj)
    code, doc = post(webhook["port"], path, req, webhook["ca"])
    assert code == 200, (code, doc, webhook["log"]())
    assert doc["apiVersion"] == "admission.k8s.io/v1" and doc["kind"] == "AdmissionReview"
    resp = doc["response"]
    assert resp["uid"] == req["request"]["uid"] and resp["allowed"] is True, resp
    return resp


def check_injected(patched: dict, original: dict) -> None:
    vols = [v for v in patched["spec"]["volumes"] if v["name"] == "ingero-profiler-plugin"]
    assert vols == [{"name": "ingero-profiler-plugin", "hostPath": {"path": PLUGIN_DIR, "type": "DirectoryOrCreate"}}]
    for before, c in zip(original["spec"]["containers"], patched["spec"]["containers"]):
        assert c["env"] == (before.get("env") or []) + [{"name": "NCCL_PROFILER_PLUGIN", "value": PLUGIN}]
        assert c["volumeMounts"] == (before.get("volumeMounts") or []) + [
            {"name": "ingero-profiler-plugin", "mountPath": PLUGIN_DIR, "readOnly": True}]
    # Nothing else changed.
    rest = copy.deepcopy(patched)
    rest["spec"]["volumes"] = [v for v in rest["spec"]["volumes"] if v["name"] != "ingero-profiler-plugin"]
    if not rest["spec"]["volumes"] and "volumes" not in original["spec"]:
        del rest["spec"]["volumes"]
    for c, before in zip(rest["spec"]["containers"], original["spec"]["containers"]):
        c["env"] = c["env"][:-1]
        c["volumeMounts"] = c["volumeMounts"][:-1]
        for k in ("env", "volumeMounts"):
            if not c[k] and k not in before:
                del c[k]
    assert rest == original


def test_an_opted_in_pod_gets_the_plugin_env_and_the_read_only_host_folder_in_every_container(webhook):
    p = pod("trainer-0", {"ingero.io/profiler": "enabled", "job-name": "j"},
            volumes=[{"name": "data", "emptyDir": {}}])
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    resp = admit(webhook, "/profiler-pod", p)
    patched = apply_patch(p, resp)
    check_injected(patched, p)
    # The patch adds; it replaces nothing the pod had.
    ops = json.loads(base64.b64decode(resp["patch"]))
    assert {op["op"] for op in ops} == {"add"}, ops
    # (c) the same pod again, patched: left alone.
    resp = admit(webhook, "/profiler-pod", patched)
    assert "patch" not in resp, resp


def test_a_pod_without_the_label_is_admitted_unchanged(webhook):
    for labels in ({}, {"ingero.io/profiler": "disabled"}, {"ingero.io/profiler": "yes"}):
        resp = admit(webhook, "/profiler-pod", pod("plain", labels))
        assert "patch" not in resp and "patchType" not in resp, (labels, resp)


def test_a_pod_that_sets_the_plugin_variable_or_mounts_the_folder_itself_is_left_alone(webhook):
    own = pod("own", {"ingero.io/profiler": "enabled"})
    own["spec"]["containers"][1]["env"] = [{"name": "NCCL_PROFILER_PLUGIN", "value": "/opt/inspector.so"}]
    busy = pod("busy", {"ingero.io/profiler": "enabled"}, volumes=[{"name": "x", "emptyDir": {}}])
    busy["spec"]["containers"][0]["volumeMounts"] = [{"name": "x", "mountPath": PLUGIN_DIR + "/"}]
    for p in (own, busy):
        resp = admit(webhook, "/profiler-pod", p)
        assert "patch" not in resp, (p["metadata"]["name"], resp)


def test_the_namespace_hook_injects_unlabelled_pods_and_respects_a_pods_opt_out(webhook):
    p = pod("ns-0", {"job-name": "j"}, containers=1)
    check_injected(apply_patch(p, admit(webhook, "/profiler-namespace", p)), p)
    resp = admit(webhook, "/profiler-namespace", pod("ns-1", {"ingero.io/profiler": "disabled"}))
    assert "patch" not in resp, resp


def test_the_server_certificate_is_checked_by_ca_and_name(webhook, tmp_path):
    make_ca_and_cert(tmp_path, SERVICE_DNS, ca="other")   # another CA, same name
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        post(webhook["port"], "/profiler-pod", review(pod("x")), tmp_path / "other.crt")
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        post(webhook["port"], "/profiler-pod", review(pod("x")), webhook["ca"], name="ingero-operator.ingero-system.svc")


def test_a_pod_the_handler_cannot_read_is_admitted_unchanged_never_denied(webhook):
    odd = pod("odd", {"ingero.io/profiler": "enabled"})
    odd["spec"]["containers"] = ["not-a-container"]
    resp = admit(webhook, "/profiler-pod", odd)
    assert "patch" not in resp and "status" not in resp, resp
    assert "not injected: AttributeError" in webhook["log"]()


def post_raw(webhook, body: bytes) -> tuple[int, str]:
    ctx = ssl.create_default_context(cafile=str(webhook["ca"]))
    conn = ServiceConnection(SERVICE_DNS, webhook["port"], context=ctx, timeout=30)
    try:
        conn.request("POST", "/profiler-pod", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def test_malformed_reviews_are_400s_naming_the_problem_and_leave_no_traceback(webhook):
    """An HTTP error makes the API server apply the failure policy (Ignore: the pod is admitted)."""
    good = review(pod("x", {"ingero.io/profiler": "enabled"}))
    no_user = copy.deepcopy(good)
    del no_user["request"]["userInfo"]
    cases = {
        "array": (b"[]", "must be a JSON object"),
        "no-request": (json.dumps({"kind": "AdmissionReview"}).encode(), "no request"),
        "null-request": (json.dumps({"kind": "AdmissionReview", "request": None}).encode(), "no request"),
        "no-uid": (json.dumps({"kind": "AdmissionReview", "request": {}}).encode(), "uid"),
        "no-user": (json.dumps(no_user).encode(), "userInfo"),
        "object-text": (json.dumps({**good, "request": {**good["request"], "object": "pod"}}).encode(), "object"),
        "nested": (b'{"request": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
        "not-json": (b"{", "not JSON"),
    }
    for name, (body, words) in cases.items():
        code, text = post_raw(webhook, body)
        assert code == 400 and words in text and "\n" not in text.strip(), (name, code, text)
    log = webhook["log"]()
    assert "Traceback" not in log and "Error handling request" not in log, log
    resp = admit(webhook, "/profiler-pod", pod("after", {"ingero.io/profiler": "enabled"}))
    assert resp.get("patch"), resp      # and the server still serves


def test_an_update_review_gets_no_patch(webhook):
    p = pod("upd", {"ingero.io/profiler": "enabled"})
    req = review(p, operation="UPDATE")
    req["request"]["oldObject"] = p
    code, doc = post(webhook["port"], "/profiler-pod", req, webhook["ca"])
    assert code == 200 and doc["response"]["allowed"] is True, (code, doc)
    assert "patch" not in doc["response"], doc


def run_cli(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ingero", "operator", "run", "--standalone",
                           "--artifacts", str(tmp / "art"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, KUBECONFIG=str(tmp / "none")))


@pytest.mark.parametrize("case,words", [
    ("no-cert", "--webhook-port needs --webhook-cert and --webhook-key"),
    ("cert-without-port", "add --webhook-port"),
    ("missing-cert", "does not exist"),
    ("key-of-another-cert", "cannot load them"),
    ("relative-dir", "must be an absolute folder"),
    ("taken-port", "pick a free port"),
])
def test_bad_webhook_flags_stop_the_start_in_one_line(tmp_path, case, words):
    make_ca_and_cert(tmp_path, SERVICE_DNS)
    base = ["--webhook-port", str(free_port()), "--webhook-address", "127.0.0.1",
            "--webhook-cert", str(tmp_path / "tls.crt"), "--webhook-key", str(tmp_path / "tls.key")]
    args = {"no-cert": base[:4],
            "cert-without-port": base[4:],
            "missing-cert": base[:5] + [str(tmp_path / "nope.crt")] + base[6:],
            "key-of-another-cert": base[:7] + [str(tmp_path / "ca.key")],
            "relative-dir": base + ["--profiler-plugin-dir", "var/lib/ingero/plugin"],
            "taken-port": base}[case]
    with socket.socket() as held:
        if case == "taken-port":
            held.bind(("127.0.0.1", int(base[1])))
            held.listen()
        p = run_cli(*args, tmp=tmp_path)
    err = p.stderr.strip()
    assert p.returncode != 0 and words in err, err
    assert "\n" not in err and "Traceback" not in err, err


def test_500_half_open_connections_delay_no_admission(webhook):
    """kopf's server is aiohttp on the operator's loop: no thread per connection; half-open
    peers (no ClientHello) cost a socket each until asyncio's handshake timeout."""
    socks = [socket.create_connection(("127.0.0.1", webhook["port"]), timeout=5) for _ in range(500)]
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        admit(webhook, "/profiler-pod", pod("crowded", {"ingero.io/profiler": "enabled"}))
        assert time.monotonic() - t0 < 2
    finally:
        for s in socks:
            s.close()
