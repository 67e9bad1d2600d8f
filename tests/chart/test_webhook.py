"""The chart's profiler-plugin webhook: MutatingWebhookConfiguration, Service, TLS Secret, operator flags.

The certificate the chart generates is checked the way the API server uses it: a TLS
handshake with the real operator (started with the rendered flags, the rendered Secret's
certificate and key), verified with the configuration's caBundle for the Service's DNS
name, and an AdmissionReview posted to each webhook's rendered path. Which pods each
webhook's selectors send is evaluated with Kubernetes' label-selector rules.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
import uuid

import pytest
import yaml

from tests.chart.chartlib import CHART, NAMESPACE, RELEASE, ROOT, args_of, container, find, helm, render, \
    render_files

ON = {"webhook": {"enabled": True}}
LABEL = "ingero.io/profiler"


def webhook_objects(values=None, **kw):
    docs = render(values if values is not None else ON, **kw)
    return (find(docs, "MutatingWebhookConfiguration"), find(docs, "Service", "ingero-operator-webhook"),
            find(docs, "Secret", "ingero-operator-webhook-tls"), docs)


def test_off_by_default_and_nothing_of_it_rendered():
    docs = render()
    assert not [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    assert "ingero-operator-webhook" not in {d["metadata"]["name"] for d in docs}
    op = container(docs, "Deployment", "operator")
    assert not [a for a in op["args"] if a.startswith(("--webhook", "--profiler-plugin-dir"))]
    assert "webhook" not in {p["name"] for p in op["ports"]}


def test_both_webhooks_ignore_failures_call_the_operator_service_and_only_on_pod_creation():
    mwc, svc, _, docs = webhook_objects()
    op = container(docs, "Deployment", "operator")
    port = {p["name"]: p["containerPort"] for p in op["ports"]}["webhook"]
    assert args_of(op)["--webhook-port"] == [str(port)] == ["9443"]
    assert svc["spec"]["selector"] == find(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    hooks = {h["name"]: h for h in mwc["webhooks"]}
    assert set(hooks) == {"pod.profiler.ingero.io", "namespace.profiler.ingero.io"}
    for h in hooks.values():
        assert h["failurePolicy"] == "Ignore" and h["sideEffects"] == "None"
        assert h["admissionReviewVersions"] == ["v1"] and h["timeoutSeconds"] == 5
        assert h["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                               "resources": ["pods"], "scope": "Namespaced"}]
        s = h["clientConfig"]["service"]
        assert (s["name"], s["namespace"], s["port"]) == ("ingero-operator-webhook", NAMESPACE, 443)
    assert hooks["pod.profiler.ingero.io"]["clientConfig"]["service"]["path"] == "/profiler-pod"
    assert hooks["namespace.profiler.ingero.io"]["clientConfig"]["service"]["path"] == "/profiler-namespace"
    mwc2, _, _, _ = webhook_objects({"webhook": {"enabled": True, "timeoutSeconds": 2}})
    assert {h["timeoutSeconds"] for h in mwc2["webhooks"]} == {2}


# ---- Kubernetes' label selector semantics (apimachinery labels.Selector) --------------------

def matches(selector: dict | None, labels: dict) -> bool:
    if selector is None:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        ok = {"In": k in labels and labels[k] in vals, "NotIn": not (k in labels and labels[k] in vals),
              "Exists": k in labels, "DoesNotExist": k not in labels}[op]
        if not ok:
            return False
    return True


def called(mwc: dict, namespace: str, ns_labels: dict, pod_labels: dict) -> list[str]:
    """The webhooks the API server calls for a pod created in `namespace`."""
    ns_labels = dict(ns_labels, **{"kubernetes.io/metadata.name": namespace})
    return [h["clientConfig"]["service"]["path"] for h in mwc["webhooks"]
            if matches(h.get("namespaceSelector"), ns_labels) and matches(h.get("objectSelector"), pod_labels)]


@pytest.mark.parametrize("ns_labels,pod_labels,paths", [
    ({}, {LABEL: "enabled", "job-name": "j"}, ["/profiler-pod"]),
    ({}, {"job-name": "j"}, []),
    ({}, {LABEL: "disabled"}, []),
    ({LABEL: "enabled"}, {"job-name": "j"}, ["/profiler-namespace"]),
    ({LABEL: "enabled"}, {LABEL: "enabled"}, ["/profiler-pod"]),     # once, not twice
    ({LABEL: "enabled"}, {LABEL: "disabled"}, []),                    # a pod's opt-out
    ({LABEL: "disabled"}, {"job-name": "j"}, []),
])
def test_the_selectors_send_exactly_the_opted_in_pods_to_one_webhook(ns_labels, pod_labels, paths):
    mwc, _, _, _ = webhook_objects()
    assert called(mwc, "team-a", ns_labels, pod_labels) == paths


def test_the_release_namespace_and_kube_system_are_never_mutated():
    mwc, _, _, _ = webhook_objects()
    for ns in (NAMESPACE, "kube-system"):
        assert called(mwc, ns, {LABEL: "enabled"}, {LABEL: "enabled"}) == []
        assert called(mwc, ns, {LABEL: "enabled"}, {}) == []


@pytest.mark.parametrize("level,paths", [("privileged", ["/profiler-pod"]), ("baseline", []), ("restricted", [])])
def test_namespaces_whose_pod_security_level_forbids_host_paths_are_not_mutated(level, paths):
    # A mutated pod there would be refused by Pod Security admission: never block a pod.
    mwc, _, _, _ = webhook_objects()
    psa = {"pod-security.kubernetes.io/enforce": level}
    assert called(mwc, "team-a", psa, {LABEL: "enabled"}) == paths
    assert called(mwc, "team-a", {**psa, LABEL: "enabled"}, {}) == [p.replace("pod", "namespace") for p in paths]


# ---- TLS ---------------------------------------------------------------------------------

def pem(b64: str) -> bytes:
    return base64.b64decode(b64)


def test_generated_ca_signs_a_certificate_for_the_service_and_is_the_ca_bundle_of_both_webhooks():
    x509 = pytest.importorskip("cryptography.x509")
    mwc, _, secret, docs = webhook_objects()
    assert secret["type"] == "kubernetes.io/tls"
    bundles = {h["clientConfig"]["caBundle"] for h in mwc["webhooks"]}
    assert bundles == {secret["data"]["ca.crt"]}
    ca = x509.load_pem_x509_certificate(pem(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(pem(secret["data"]["tls.crt"]))
    assert cert.issuer == ca.subject
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"ingero-operator-webhook.{NAMESPACE}.svc" in sans
    # The operator mounts exactly that Secret's certificate and key for its flags.
    op, pod = container(docs, "Deployment", "operator"), find(docs, "Deployment")["spec"]["template"]["spec"]
    args = args_of(op)
    mount = next(m for m in op["volumeMounts"] if m["name"] == "webhook-tls")
    vol = next(v for v in pod["volumes"] if v["name"] == "webhook-tls")
    assert mount["readOnly"] is True and vol["secret"]["secretName"] == secret["metadata"]["name"]
    items = {i["key"]: f"{mount['mountPath']}/{i['path']}" for i in vol["secret"]["items"]}
    assert (items["tls.crt"], items["tls.key"]) == (args["--webhook-cert"][0], args["--webhook-key"][0])
    # Each render without a cluster makes a new CA: the Secret and the caBundle of one render agree.
    mwc2, _, secret2, _ = webhook_objects()
    assert secret2["data"]["ca.crt"] != secret["data"]["ca.crt"]


def test_an_upgrade_keeps_the_installed_certificate_by_lookup(tmp_path):
    pytest.importorskip("kmock", reason="kmock (the embedded API server) is not installed")
    from ingero_operator.embedded import EmbeddedCluster

    def objs(**kw):
        files = render_files(ON, **kw)
        docs = [d for d in yaml.safe_load_all(files[f"{RELEASE}/templates/webhook.yaml"]) if d]
        return find(docs, "Secret"), find(docs, "MutatingWebhookConfiguration")

    cluster = EmbeddedCluster(CHART / "crds" / "tracesession.yaml", tmp_path).start()
    try:
        fresh, _ = objs(kubeconfig=cluster.kubeconfig)          # nothing to look up: a new CA
        cluster.create(f"/api/v1/namespaces/{NAMESPACE}/secrets", fresh)
        for _ in range(2):
            secret, mwc = objs(kubeconfig=cluster.kubeconfig, upgrade=True)
            assert secret["data"] == fresh["data"]
            assert {h["clientConfig"]["caBundle"] for h in mwc["webhooks"]} == {fresh["data"]["ca.crt"]}
    finally:
        cluster.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_real_operator_serves_the_rendered_paths_with_a_certificate_the_ca_bundle_verifies(tmp_path):
    """The rendered operator flags, Secret and configuration, together: the operator serves
    HTTPS with the Secret's certificate, the caBundle verifies it for the Service's name, and
    each webhook's path reaches its handler, which mounts profilerPlugin.hostPath."""
    for mod in ("kmock", "kopf", "jsonpatch"):
        pytest.importorskip(mod)
    import jsonpatch

    from tests.unit.webhook_operator import post, review, running_operator

    values = {"webhook": {"enabled": True}, "profilerPlugin": {"hostPath": "/opt/site/ingero-plugin"}}
    mwc, svc, secret, docs = webhook_objects(values)
    op = container(docs, "Deployment", "operator")
    mount = next(m for m in op["volumeMounts"] if m["name"] == "webhook-tls")["mountPath"]
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(pem(secret["data"][key]))
    (tmp_path / "bundle.crt").write_bytes(pem(mwc["webhooks"][0]["clientConfig"]["caBundle"]))
    port = free_port()
    argv = []
    for a in op["args"]:
        a = a.replace(f"{mount}/", f"{tmp_path}/")
        if a.startswith("--webhook-port="):
            a = f"--webhook-port={port}"
        if a.startswith(("--artifacts=", "--liveness=", "--artifact-port=", "--artifact-service=", "--peering=",
                         "--priority=")):
            continue   # the pod's folders and ports, and peering: not what is tested here
        argv.append(a)
    assert argv[:2] == ["operator", "run"]
    with running_operator([*argv, "--standalone", "--webhook-address=127.0.0.1", f"--artifacts={tmp_path / 'artifacts'}"],
                          tmp_path, port, CHART / "crds" / "tracesession.yaml", {"POD_NAMESPACE": NAMESPACE}):
        dns = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
        pods = {"/profiler-pod": {LABEL: "enabled"}, "/profiler-namespace": {}}
        for h in mwc["webhooks"]:
            path = h["clientConfig"]["service"]["path"]
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"p{uuid.uuid4().hex[:6]}", "namespace": "team-a", "labels": pods[path]},
                   "spec": {"containers": [{"name": "trainer", "image": "t:1"}]}}
            code, doc = post(port, path, review(pod), tmp_path / "bundle.crt", name=dns)
            assert code == 200 and doc["response"]["allowed"] is True, doc
            ops = json.loads(base64.b64decode(doc["response"]["patch"]))
            out = jsonpatch.JsonPatch(ops).apply(copy.deepcopy(pod))
            c = out["spec"]["containers"][0]
            assert c["env"] == [{"name": "NCCL_PROFILER_PLUGIN",
                                 "value": "/opt/site/ingero-plugin/libnccl-profiler-ingero.so"}]
            assert out["spec"]["volumes"][0]["hostPath"]["path"] == "/opt/site/ingero-plugin"


# ---- values ------------------------------------------------------------------------------

@pytest.mark.parametrize("values,message", [
    ({"webhook": {"enabled": True}, "profilerPlugin": {"enabled": False}}, "needs profilerPlugin.enabled=true"),
    ({"webhook": {"enabled": True}, "operator": {"replicas": 0, "peering": {"enabled": False}}},
     "no operator would serve the webhook"),
    ({"webhook": {"enabled": True, "port": 443}}, "/webhook/port"),
    ({"webhook": {"enabled": True, "port": 8080}}, "webhook.port 8080 is also operator.healthPort"),
    ({"webhook": {"enabled": True, "port": 8082}}, "webhook.port 8082 is also operator.artifacts.port"),
    ({"webhook": {"enabled": True, "port": 9102}, "metrics": {"enabled": True}},
     "webhook.port 9102 is also metrics.port"),
    ({"webhook": {"enabled": True, "timeoutSeconds": 31}}, "/webhook/timeoutSeconds"),
    ({"webhook": {"enabled": True, "caBundle": "x"}}, "additional properties 'caBundle' not allowed"),
])
def test_bad_webhook_values_fail_the_render_with_a_message(values, message):
    with pytest.raises(Exception) as e:
        render(values)
    assert message in str(e.value)


def test_the_webhook_objects_lint_and_are_valid_for_kubernetes():
    report = helm().lint(str(CHART), ON, strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] > 1] == []
    kv = pytest.importorskip("kubernetes_validate")
    for version in (kv.latest_version(), "1.26"):
        for doc in webhook_objects()[:3]:
            kv.validate(doc, version, strict=True)


def test_the_webhook_adds_no_permission_kopf_does_not_manage_the_configuration():
    def rules(docs):
        return sorted(json.dumps(d.get("rules"), sort_keys=True) for d in docs if d["kind"] in ("Role", "ClusterRole"))

    on, off = render(ON), render()
    assert rules(on) == rules(off)
    assert "admissionregistration.k8s.io" not in json.dumps([d for d in on if d["kind"].endswith("Role")])
    # The operator does not ask kopf to manage it (settings.admission.managed stays None).
    src = (ROOT / "operator" / "ingero_operator" / "webhook.py").read_text()
    assert "settings.admission.managed = None" in src and "managed = '" not in src
