"""The chart's RBAC allows exactly the Kubernetes API calls the operator and the agent make.

The calls are recorded, not listed by hand: one whole flow (`ingero demo` as a library:
embedded API server, kopf operator, one real agent per lab node, a 2 x 2-rank lab job
under real eBPF) runs with the operator started with the chart's own flags (peering,
priority, watched namespaces) and the chart's peering object created, plus one session
the operator fails (status Failed; kopf posts no Event for it) and the deletion of both.
Each component runs with its own kubeconfig whose token is its service account's name,
so every request the embedded API server received tells who made it. The recorded
requests are then checked against the rendered Roles and ClusterRoles with the rules
of Kubernetes' RBAC authorizer, both ways: every call is allowed, and every (verb,
resource) a rule grants was used. Needs root and eBPF (about 15 s per mode).
"""

from __future__ import annotations

import shutil
import socket
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

import pytest
import yaml

from tests.chart.chartlib import NAMESPACE, RELEASE, ROOT, container, find, render
from tests.conftest import bpf_reason

pytestmark = pytest.mark.bpf
MODES = {"clusterwide": None, "namespaced": {"operator": {"watchNamespaces": ["default"]}}}


@dataclass(frozen=True)
class Call:
    """One API request as the authorizer sees it."""

    verb: str
    group: str | None          # None: a non-resource (discovery) request
    resource: str              # with /subresource
    namespace: str | None
    name: str | None
    path: str


def to_call(method: str, path: str, params: dict) -> Call:
    """Request attributes as kube-apiserver derives them from the URL."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        rest = []
    if not rest:   # /api, /apis, /api/v1, /apis/<group>/<version>: discovery
        return Call(method.lower(), None, path, None, None, path)
    ns = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        ns, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    if method == "GET":
        verb = "watch" if params.get("watch") in ("true", "1") else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}[method]
    return Call(verb, group, f"{resource}/{sub}" if sub else resource, ns, name, path)


def rule_allows(rule: dict, call: Call) -> bool:
    return ((call.group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
            and (call.resource in rule.get("resources", []) or "*" in rule.get("resources", []))
            and (call.verb in rule["verbs"] or "*" in rule["verbs"])
            and (not rule.get("resourceNames") or call.name in rule["resourceNames"]))


def grants(docs: list[dict], sa: str, sa_ns: str) -> list[tuple[str | None, dict]]:
    """(namespace or None for cluster-wide, rule) for every rule bound to the service account."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}
    out = []
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == sa_ns for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if b["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        out += [(ns, rule) for rule in role["rules"]]
    return out


def allowed(call: Call, rules: list[tuple[str | None, dict]]) -> bool:
    return any(rule_allows(rule, call) and (ns is None or call.namespace == ns) for ns, rule in rules)


def test_the_authorizer_model_follows_kubernetes_rbac_rules():
    rules = [(None, {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}),
             ("ns1", {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["tok"], "verbs": ["get"]})]
    assert allowed(to_call("GET", "/api/v1/namespaces/x/pods", {}), rules)
    assert not allowed(to_call("GET", "/api/v1/namespaces/x/pods", {"watch": "true"}), rules)
    assert not allowed(to_call("GET", "/api/v1/namespaces/x/pods/p", {}), rules)          # get, not list
    assert allowed(to_call("GET", "/api/v1/namespaces/ns1/secrets/tok", {}), rules)
    assert not allowed(to_call("GET", "/api/v1/namespaces/ns2/secrets/tok", {}), rules)   # other namespace
    assert not allowed(to_call("GET", "/api/v1/namespaces/ns1/secrets/other", {}), rules)  # other name
    assert not allowed(to_call("GET", "/api/v1/namespaces/ns1/secrets", {}), rules)       # list ignores names
    c = to_call("PATCH", "/apis/ingero.io/v1alpha1/namespaces/d/tracesessions/t/status", {})
    assert (c.verb, c.group, c.resource, c.namespace, c.name) == ("patch", "ingero.io", "tracesessions/status", "d", "t")
    assert to_call("GET", "/apis/kopf.dev/v1", {}).group is None                           # discovery


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_reason() -> str | None:
    reason = bpf_reason()
    if reason:
        return reason
    if not shutil.which("kubectl"):
        return "kubectl is not installed (the flow applies TraceSessions with it)"
    for mod in ("kmock", "kopf", "jsonschema", "helm_python"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed: pip install -e '.[test]'"
    return None


@pytest.fixture(scope="module", params=list(MODES))
def recorded(request, tmp_path_factory):
    """Render the chart for one mode, run the whole flow as the chart configures the
    operator, and return (rendered objects, calls by identity, final status)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from ingero_operator import cluster_objects as objs
    from ingero_operator.demo import Demo, DemoConfig

    docs = render(MODES[request.param])
    op = container(docs, "Deployment", "operator")
    flags = []
    for a in op["args"][2:]:          # the chart's flags, minus paths that only exist in the pod
        if a.startswith("--artifacts="):
            continue
        if a.startswith("--liveness="):   # same path, a free local port
            liveness = f"http://127.0.0.1:{_free_port()}{urllib.parse.urlsplit(a.split('=', 1)[1]).path}"
            a = f"--liveness={liveness}"
        flags.append(a)
    out = tmp_path_factory.mktemp(f"rbac-{request.param}")
    cfg = DemoConfig(scenario="clean", seconds=3.0, out=out, operator_args=tuple(flags),
                     extra_crds=(ROOT / "crds" / "kopfpeering.yaml",))
    with Demo(cfg, log=lambda _m: None) as demo:
        for d in docs:    # the chart's peering objects
            if d["kind"] == "ClusterKopfPeering":
                demo.cluster.create("/apis/kopf.dev/v1/clusterkopfpeerings", d)
            elif d["kind"] == "KopfPeering":
                demo.cluster.create(f"/apis/kopf.dev/v1/namespaces/{d['metadata']['namespace']}/kopfpeerings", d)
        # A session only the operator can refuse: the failure path of the handlers; its
        # ttlSecondsAfterFinished 0 has the operator delete it once it has failed.
        bad = out / "bad.yaml"
        bad.write_text(yaml.safe_dump({"apiVersion": "ingero.io/v1alpha1", "kind": "TraceSession",
                                       "metadata": {"name": "bad-label-key", "namespace": "default"},
                                       "spec": {"selector": {"matchLabels": {"bad key!": "b"}},
                                                "ttlSecondsAfterFinished": 0}}))
        demo.kubectl("apply", "--validate=false", "-f", str(bad))
        res = demo.run()
        with urllib.request.urlopen(liveness, timeout=5) as resp:   # what the kubelet's probes ask
            health = resp.status
        for name in ("bad-label-key", demo.session_name):
            demo.kubectl("delete", "tracesession", name, "-n", "default", "--wait=false", "--ignore-not-found")
        # Wait for kopf to release a finalizer (a JSON patch removing it), at most 8 s. The
        # failed session's is released at once; on this embedded server the completed one's
        # was not within seconds (kopf logs its deletion as processed), and releasing it would
        # be the same kind of call (patch tracesessions).
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and len({r.url.path for r in list(demo.cluster.emulator)
                                                   if r.method == "PATCH" and b'"/metadata/finalizers"' in r.body
                                                   and b'"remove"' in r.body}) < 1:
            time.sleep(0.2)
        time.sleep(1.0)
        calls: dict[str, list[Call]] = {}
        for r in list(demo.cluster.emulator):
            auth = next((v for k, v in r.headers.items() if k.lower() == "authorization"), "")
            who = auth.split(" ", 1)[1] if auth.lower().startswith("bearer ") else "(no token)"
            calls.setdefault(who, []).append(to_call(str(r.method.value if hasattr(r.method, "value") else r.method),
                                                     r.url.path, dict(r.params)))
        identities = {c: objs.identity(c) for c in ("operator", "agent")}
    return docs, calls, identities, res.status, health


def test_the_recorded_flow_completed_with_the_charts_peering_flags(recorded):
    docs, calls, identities, status, health = recorded
    assert status["phase"] == "Completed", status.get("message")
    ops = calls[identities["operator"]]
    peering = [c for c in ops if c.group == "kopf.dev" and c.verb == "patch"]
    assert peering, "the operator never wrote its peering keep-alive"
    # The liveness endpoint the chart's probes use answered while the operator ran.
    probe = container(docs, "Deployment", "operator")["livenessProbe"]["httpGet"]
    assert health == 200 and probe["path"] == "/healthz"


def test_recorded_identities_are_the_charts_service_accounts(recorded):
    docs, calls, identities, _, _ = recorded
    for component in ("operator", "agent"):
        sa = find(docs, "ServiceAccount", f"{RELEASE}-{component}")
        assert identities[component] == f"system:serviceaccount:{NAMESPACE}:{sa['metadata']['name']}"


def test_every_api_call_of_the_operator_is_allowed_by_the_charts_rbac(recorded):
    docs, calls, identities, _, _ = recorded
    sa = identities["operator"].rsplit(":", 2)
    rules = grants(docs, sa[2], sa[1])
    ops = [c for c in calls[identities["operator"]] if c.group is not None]
    assert len(ops) > 10
    denied = sorted({(c.verb, c.path) for c in ops if not allowed(c, rules)})
    assert denied == []
    # Discovery (/api, /apis, /apis/<group>/<version>) is open to every authenticated user
    # (ClusterRole system:discovery); nothing else is non-resource.
    assert all(c.verb == "get" for c in calls[identities["operator"]] if c.group is None)


def test_every_permission_the_chart_grants_the_operator_was_used(recorded):
    docs, calls, identities, _, _ = recorded
    sa = identities["operator"].rsplit(":", 2)
    ops = [c for c in calls[identities["operator"]] if c.group is not None]
    unused = []
    for ns, rule in grants(docs, sa[2], sa[1]):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    narrow = dict(rule, apiGroups=[group], resources=[resource], verbs=[verb])
                    if not any(rule_allows(narrow, c) and (ns is None or c.namespace == ns) for c in ops):
                        unused.append((ns or "cluster-wide", group, resource, verb, rule.get("resourceNames")))
    assert unused == []
    # Every kind of call the operator makes, once (the record behind the rules above).
    kinds = sorted({(c.verb, c.group, c.resource) for c in ops})
    assert ("get", "", "secrets") in kinds and [k for k in kinds if k[2] == "events"] == [("create", "", "events")]
    assert ("patch", "ingero.io", "tracesessions/status") in kinds and ("watch", "ingero.io", "tracesessions") in kinds


def test_the_agent_makes_no_api_call_and_is_granted_none(recorded):
    docs, calls, identities, _, _ = recorded
    assert calls.get(identities["agent"], []) == []
    sa = identities["agent"].rsplit(":", 2)
    assert grants(docs, sa[2], sa[1]) == []
    assert find(docs, "ServiceAccount", sa[2])["automountServiceAccountToken"] is False
