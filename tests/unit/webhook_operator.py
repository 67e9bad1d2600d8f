"""The profiler-plugin admission webhook as the API server calls it (AdmissionReview v1 over
HTTPS), shared by the tests that need it: import `webhook` into a test module for an operator
of its own (module scope).

The real operator (`ingero operator run --webhook-port ...`, a process, its bounded
WebhookServer) against the embedded API server; a test CA signs the server's certificate
for the webhook Service's DNS name only, and every request verifies it with that CA and
that name, as the API server does with the configuration's caBundle.
"""

from __future__ import annotations

import base64
import contextlib
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

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed (test CA)")


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


@contextlib.contextmanager
def running_operator(argv: list[str], tmp: Path, port: int, crd: Path = ROOT / "crds" / "tracesession.yaml",
                     env: dict | None = None):
    """`ingero <argv>` (an operator serving its webhook on `port`) against an embedded API
    server in `tmp`, once the webhook listens: (the process, the tail of its log)."""
    from ingero_operator.embedded import EmbeddedCluster

    cluster = EmbeddedCluster(crd, tmp / "api").start()
    log = open(tmp / "operator.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ingero", *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), **(env or {})))

    def operator_log() -> str:
        return (tmp / "operator.log").read_text(errors="replace")[-4000:]

    try:
        deadline = time.monotonic() + 60
        while True:    # kopf starts the server once it has scanned the API's resources
            assert proc.poll() is None, f"the operator exited:\n{operator_log()}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"the webhook never listened:\n{operator_log()}"
                time.sleep(0.2)
        yield proc, operator_log
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        cluster.stop()


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    for mod in ("kmock", "kopf", "jsonschema"):
        pytest.importorskip(mod, reason=f"{mod} is not installed: pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("webhook")
    make_ca_and_cert(tmp, SERVICE_DNS)
    port = free_port()
    argv = ["operator", "run", "--standalone", "--namespace", "ingero-system", "--artifacts", str(tmp / "artifacts"),
            "--webhook-port", str(port), "--webhook-address", "127.0.0.1", "--webhook-cert", str(tmp / "tls.crt"),
            "--webhook-key", str(tmp / "tls.key"), "--profiler-plugin-dir", PLUGIN_DIR, "--log-level", "debug"]
    with running_operator(argv, tmp, port) as (proc, operator_log):
        yield {"port": port, "ca": tmp / "ca.crt", "tmp": tmp, "log": operator_log, "pid": proc.pid}


def admit(webhook, path: str, obj: dict) -> dict:
    req = review(obj)
    code, doc = post(webhook["port"], path, req, webhook["ca"])
    assert code == 200, (code, doc, webhook["log"]())
    assert doc["apiVersion"] == "admission.k8s.io/v1" and doc["kind"] == "AdmissionReview"
    resp = doc["response"]
    assert resp["uid"] == req["request"]["uid"] and resp["allowed"] is True, resp
    return resp


def post_raw(webhook, body: bytes, path: str = "/profiler-pod", chunked: bool = False) -> tuple[int, str]:
    """POST `body` as it is (with `chunked`, in chunks with no Content-Length)."""
    ctx = ssl.create_default_context(cafile=str(webhook["ca"]))
    conn = ServiceConnection(SERVICE_DNS, webhook["port"], context=ctx, timeout=30)
    try:
        if chunked:
            conn.request("POST", path, (body[i:i + (64 << 10)] for i in range(0, len(body), 64 << 10)),
                         {"Content-Type": "application/json"}, encode_chunked=True)
        else:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()
