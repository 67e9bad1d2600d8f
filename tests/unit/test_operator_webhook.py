"""The profiler-plugin admission webhook, as the API server calls it: injection into the pods that
opt in, and the operator's webhook flags (tests/unit/webhook_operator.py starts the operator;
malformed and hostile requests are tests/security/test_attack_webhook.py)."""

from __future__ import annotations

import base64
import copy
import json
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.webhook_operator import (PLUGIN, PLUGIN_DIR, ROOT, SERVICE_DNS, admit, apply_patch,  # noqa: F401
                                         free_port, make_ca_and_cert, needs_openssl, pod, post, review, webhook)

pytestmark = needs_openssl

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




def test_a_renewed_certificate_is_served_to_new_connections_without_a_restart(tmp_path):
    """The WebhookServer alone (kopf's `fn` replaced by one that admits): the files of the
    mounted Secret change, and the next handshake presents the new certificate."""
    import asyncio
    import contextlib
    import shutil as sh

    from ingero import serving
    from ingero_operator import webhook as wh

    make_ca_and_cert(tmp_path, SERVICE_DNS)
    cfg = wh.WebhookConfig(address="127.0.0.1", cert=tmp_path / "tls.crt", key=tmp_path / "tls.key")
    sock = serving.bind(0, "127.0.0.1")
    port = sock.getsockname()[1]
    hooks = []

    async def fn(doc, webhook=None, **_):
        hooks.append(webhook)
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": doc["request"]["uid"], "allowed": True}}

    async def go():
        serve = wh.WebhookServer(cfg, sock, cert_check_s=0.1)(fn)
        assert (await serve.__anext__())["url"] == f"https://127.0.0.1:{port}"
        running = asyncio.ensure_future(serve.__anext__())       # what kopf's `async for` does
        try:
            code, doc = await asyncio.to_thread(post, port, "/profiler-namespace", review(pod("x")), tmp_path / "ca.crt")
            assert code == 200 and doc["response"]["allowed"] is True and hooks == ["profiler-namespace"]
            (tmp_path / "new").mkdir()
            make_ca_and_cert(tmp_path / "new", SERVICE_DNS, ca="ca2")
            for f in ("tls.key", "tls.crt"):
                sh.copy(tmp_path / "new" / f, tmp_path / f)
            await asyncio.sleep(1.0)
            with pytest.raises(ssl.SSLCertVerificationError):
                await asyncio.to_thread(post, port, "/profiler-pod", review(pod("x")), tmp_path / "ca.crt")
            code, _ = await asyncio.to_thread(post, port, "/profiler-pod", review(pod("x")), tmp_path / "new" / "ca2.crt")
            assert code == 200 and hooks[-1] == "profiler-pod"
        finally:
            running.cancel()                    # as kopf stops it: the server closes
            with contextlib.suppress(asyncio.CancelledError):
                await running

    asyncio.run(go())
    sock.close()
