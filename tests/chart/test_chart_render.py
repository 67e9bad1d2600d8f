"""The Helm chart rendered by Helm's own engine (helm-python-sdk), for the default values and
non-default sets: lint, Kubernetes schema validation, the values schema, the `fail` guards,
and the contract between the rendered objects and the operator and agent code."""

from __future__ import annotations

import base64
import shlex

import jsonschema
import pytest
import yaml

from tests.chart.chartlib import (CHART, NAMESPACE, OLDEST_KUBE, RELEASE, args_of, container, crd_docs, find,
                                  helm, render, render_files)

NON_DEFAULT = {
    "tls": {"enabled": True, "secretName": "ingero-agent-tls"},
    "agent": {"privileged": True,
              "tolerations": [{"key": "example.com/training", "operator": "Equal", "value": "yes",
                               "effect": "NoExecute", "tolerationSeconds": 600}],
              "nodeSelector": {"example.com/gpu": "a100"}, "kernelHeaders": {"linkOnHost": True}},
    "operator": {"replicas": 2, "artifacts": {"existingClaim": "ingero-artifacts"}, "verbose": True,
                 "liveWindowSeconds": 0},
    "token": {"value": "0123456789abcdef0123456789abcdef"},
    "metrics": {"enabled": True},
}
# Escape hatches: a site with a proxy, a custom CA and a Pod Security label, without a fork.
HATCHES = {"podLabels": {"team": "ml-infra"},
           "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
                        {"name": "SSL_CERT_FILE", "value": "/etc/site-ca/ca.crt"}],
           "extraArgs": ["--quiet"],
           "extraVolumes": [{"name": "site-ca", "configMap": {"name": "site-ca"}}],
           "extraVolumeMounts": [{"name": "site-ca", "mountPath": "/etc/site-ca", "readOnly": True}]}
NON_DEFAULT["agent"].update(HATCHES, podSecurityContext={"seLinuxOptions": {"type": "spc_t"}},
                            updateStrategy={"type": "OnDelete"}, logFormat="json", logLevel="warning")
NON_DEFAULT["operator"].update(logFormat="json", logLevel="debug")
NON_DEFAULT["operator"].update({k: v for k, v in HATCHES.items() if k != "extraArgs"},
                               extraArgs=["--verbose"])
NAMESPACED = {"operator": {"watchNamespaces": ["team-a", "team-b"]},
              "token": {"existingSecret": "my-agent-token"},
              "agent": {"extraCapabilities": ["SYS_ADMIN"], "listenAddress": "[::]"}}
VALUE_SETS = {"default": None, "non-default": NON_DEFAULT, "namespaced": NAMESPACED}


def kube_validate():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed: "
                               "pip install -e '.[test]'")


# ---- render and lint --------------------------------------------------------------------

def test_default_values_install_crds_operator_agent_rbac_secret_service_and_peering():
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in render())
    assert kinds == sorted([
        ("Secret", "ingero-agent-token"), ("ServiceAccount", "ingero-operator"),
        ("ServiceAccount", "ingero-agent"), ("Service", "ingero-agent"), ("ClusterKopfPeering", "ingero"),
        ("ClusterRole", "ingero-operator"), ("ClusterRoleBinding", "ingero-operator"),
        ("Role", "ingero-operator-agents"), ("RoleBinding", "ingero-operator-agents"),
        ("Deployment", "ingero-operator"), ("DaemonSet", "ingero-agent"),
        ("Service", "ingero-operator"), ("ClusterRole", "ingero-artifact-reader"),
        ("Service", "ingero-operator-metrics"),         # metrics on by default
        # secure by default: the agents' generated certificate, NetworkPolicies of both
        ("Secret", "ingero-agent-tls"), ("NetworkPolicy", "ingero-agent"), ("NetworkPolicy", "ingero-operator")])
    assert sorted(d["metadata"]["name"] for d in crd_docs()) == [
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev", "tracesessions.ingero.io"]


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_chart_lints_without_warnings_in_strict_mode(values):
    report = helm().lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 1 is informational (only "icon is recommended": the project has no icon).
    assert [m for m in report["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize("kube", ["latest", OLDEST_KUBE])
@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_every_rendered_object_is_valid_for_kubernetes(values, kube):
    kv = kube_validate()
    version = kv.latest_version() if kube == "latest" else kube
    crds = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c for c in crd_docs()}
    for doc in render(values) + crd_docs():
        group = doc["apiVersion"].rpartition("/")[0]
        if (group, doc["kind"]) in crds:   # custom resources: the chart's own CRD schema
            schema = crds[(group, doc["kind"])]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            jsonschema.validate(doc, schema)
            continue
        try:
            kv.validate(doc, version, strict=True)   # strict: unknown fields are errors
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} is invalid for Kubernetes {version}: {e.message} "
                        f"at {'.'.join(map(str, e.path))}")


# ---- non-default values ------------------------------------------------------------------

def test_tls_mounts_the_cert_secret_and_passes_the_flags_to_agent_and_operator():
    docs = render(NON_DEFAULT)
    agent = container(docs, "DaemonSet", "agent")
    args = args_of(agent)
    assert args["--tls-cert"] == ["/etc/ingero/tls/tls.crt"] and args["--tls-key"] == ["/etc/ingero/tls/tls.key"]
    ds_vols = {v["name"]: v for v in find(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert ds_vols["tls"]["secret"]["secretName"] == "ingero-agent-tls"
    assert {"name": "tls", "mountPath": "/etc/ingero/tls", "readOnly": True} in agent["volumeMounts"]
    assert all(p[k]["httpGet"]["scheme"] == "HTTPS" for p in [agent] for k in
               ("startupProbe", "livenessProbe", "readinessProbe"))
    op = container(docs, "Deployment", "operator")
    env = {e["name"]: e.get("value") for e in op["env"]}
    assert env["INGERO_AGENT_TLS"] == "1" and env["INGERO_AGENT_CA_FILE"] == "/etc/ingero/tls/ca.crt"
    assert env["INGERO_AGENT_TLS_SERVER_NAME"] == f"ingero-agent.{NAMESPACE}.svc"
    op_vols = {v["name"]: v for v in find(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    # The operator gets the CA only, never the agents' private key.
    assert op_vols["tls-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_custom_tolerations_and_node_selector_replace_the_gpu_defaults():
    default = find(render(), "DaemonSet")["spec"]["template"]["spec"]
    assert default["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pod = find(render(NON_DEFAULT), "DaemonSet")["spec"]["template"]["spec"]
    assert pod["tolerations"] == NON_DEFAULT["agent"]["tolerations"]
    assert pod["nodeSelector"] == {"example.com/gpu": "a100"}


def test_privileged_fallback_replaces_the_capability_list_and_default_drops_all():
    sc = container(render(NON_DEFAULT), "DaemonSet", "agent")["securityContext"]
    assert sc["privileged"] is True and "capabilities" not in sc
    sc = container(render(), "DaemonSet", "agent")["securityContext"]
    assert "privileged" not in sc and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"],
                                  "add": ["BPF", "PERFMON", "SYS_PTRACE"]}   # tests/bpf/test_capabilities.py
    sc = container(render(NAMESPACED), "DaemonSet", "agent")["securityContext"]
    assert sc["capabilities"]["add"][-1] == "SYS_ADMIN"


def test_every_added_capability_has_a_comment_saying_why():
    text = (CHART / "templates" / "_agent_security.tpl").read_text().splitlines()
    start = next(i for i, ln in enumerate(text) if ln.strip() == "add:")
    caps = [i for i in range(start + 1, len(text)) if text[i].strip().startswith("- ") and
            text[i].strip()[2:].isupper()]
    assert len(caps) == 3
    for i in caps:
        assert text[i - 1].strip().startswith("#"), f"no comment above {text[i].strip()}"


def test_multiple_replicas_run_with_peering_and_a_random_priority_each():
    docs = render(NON_DEFAULT)
    dep = find(docs, "Deployment")
    args = args_of(dep["spec"]["template"]["spec"]["containers"][0])
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert args["--peering"] == [find(docs, "ClusterKopfPeering")["metadata"]["name"]]
    assert args["--priority"] == ["random"] and "--standalone" not in args
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in
           dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_ID"] == "metadata.name"   # kopf's peer identity


def test_without_peering_a_single_operator_is_recreated_never_overlapping():
    docs = render({"operator": {"peering": {"enabled": False}}})
    dep = find(docs, "Deployment")
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    assert "--standalone" in args_of(dep["spec"]["template"]["spec"]["containers"][0])
    assert not [d for d in docs if "KopfPeering" in d["kind"]]


def test_namespaced_mode_grants_roles_and_peering_only_in_the_watched_namespaces():
    docs = render(NAMESPACED)
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering")]
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role"}
    assert roles == {("team-a", "ingero-operator"), ("team-b", "ingero-operator"),
                     (NAMESPACE, "ingero-operator-agents"), (NAMESPACE, "ingero-artifact-reader")}
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] == "KopfPeering"} == {"team-a", "team-b"}
    args = args_of(container(docs, "Deployment", "operator"))
    assert args["--watch-namespace"] == ["team-a", "team-b"]
    # An existing token Secret: none created (only the agents' generated certificate), and the
    # operator is told its name.
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == ["ingero-agent-tls"]
    env = {e["name"]: e.get("value") for e in container(docs, "Deployment", "operator")["env"]}
    assert env["INGERO_AGENT_TOKEN_SECRET"] == "my-agent-token"


# ---- the rendered objects match what the code reads ---------------------------------------

def test_rendered_args_parse_with_the_real_cli_and_the_operator_settings_match_the_objects():
    from ingero.cli import build_parser
    from ingero_operator import settings as st

    for values in (None, NON_DEFAULT):
        docs = render(values)
        agent, op = container(docs, "DaemonSet", "agent"), container(docs, "Deployment", "operator")
        node_env = "$(NODE_NAME)"
        a = build_parser().parse_args([x.replace(node_env, "node-1") for x in agent["args"]])
        assert (a.command, a.agent_command, a.node) == ("agent", "serve", "node-1")
        assert a.listen.endswith(f":{agent['ports'][0]['containerPort']}")
        pre = find(docs, "DaemonSet")["spec"]["template"]["spec"]["initContainers"][0]
        t = build_parser().parse_args(pre["args"])
        assert (t.command, t.all, t.duration, t.probes) == ("trace", True, "1s", "tcp,sched")
        assert str(t.out).startswith("/tmp/")
        o = build_parser().parse_args(op["args"])
        assert (o.command, o.operator_command) == ("operator", "run")
        assert o.live_window == (0.0 if values else st.TimingSettings().live_window_s)
        # The operator resolves its settings from the rendered env ...
        env = {e["name"]: e["value"] for e in op["env"] if "value" in e}
        env["POD_NAMESPACE"] = NAMESPACE
        s = st.Settings.from_env(env)
        # ... which names the Secret the chart creates and the agent mounts ...
        secret = find(docs, "Secret", env["INGERO_AGENT_TOKEN_SECRET"])
        assert s.agent.token_secret == secret["metadata"]["name"] and s.namespace == secret["metadata"]["namespace"]
        assert s.agent.token_key in secret["data"]
        token_vol = next(v for v in find(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
                         if v["name"] == "token")
        assert token_vol["secret"]["secretName"] == s.agent.token_secret
        assert a.token_file.name == token_vol["secret"]["items"][0]["path"]
        # ... and finds the agent pods by their labels and port name.
        labels = find(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
        assert s.agent.labels.items() <= labels.items()
        assert agent["ports"][0]["name"] == s.agent.port_name
        # TLS is on by default (generated certificate) and with NON_DEFAULT's own Secret.
        assert s.agent.tls is True and s.agent.tls_server_name == f"ingero-agent.{NAMESPACE}.svc"
        tls_vol = next(v for v in find(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        if values is None:     # the chart generates the agents' certificate Secret it mounts
            assert find(docs, "Secret", tls_vol["secret"]["secretName"])["type"] == "kubernetes.io/tls"


def test_agent_pods_get_no_service_account_token_and_no_role():
    docs = render()
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["hostPID"] is True
    sa = pod["serviceAccountName"]
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert all(s["name"] != sa for s in b["subjects"]), b["metadata"]["name"]


# ---- invalid values ------------------------------------------------------------------------

@pytest.mark.parametrize("values,message", [
    ({"tls": {"enabled": False, "certManager": {"enabled": True}}}, "tls.certManager.enabled=true needs tls.enabled"),
    ({"tls": {"certManager": {"issuerRef": {"name": "ca"}}}}, "tls.certManager.issuerRef.name is set but"),
    ({"tls": {"caKey": "root.pem"}}, "tls.caKey applies to your own Secret"),
    ({"tls": {"caKey": "root.pem", "secretName": "x", "certManager": {"enabled": True}}},
     "tls.caKey applies to your own Secret"),
    ({"agent": {"privileged": True, "extraCapabilities": ["SYS_ADMIN"]}}, "agent.privileged=true grants every"),
    ({"operator": {"replicas": 3, "peering": {"enabled": False}}}, "operator.replicas > 1 needs operator.peering"),
    ({"operator": {"replicas": 0}}, "operator.replicas=0 with operator.peering.enabled=true"),
    ({"token": {"existingSecret": "x", "value": "0123456789abcdef0"}}, "token.existingSecret and token.value"),
    ({"tls": {"enabled": False, "serverName": "agents.example"}}, "tls.serverName is set but tls.enabled=false"),
    ({"tls": {"enabled": False, "mutual": True}}, "tls.mutual=true needs tls.enabled=true"),
])
def test_invalid_combinations_fail_with_a_message_naming_the_fix(values, message):
    with pytest.raises(helm().HelmRenderError, match=message.replace(".", r"\.").replace("*", r"\*")):
        render(values)


@pytest.mark.parametrize("values,where", [
    ({"agent": {"port": "9464"}}, "/agent/port"),
    ({"agent": {"port": 70000}}, "/agent/port"),
    ({"agent": {"extraCapabilities": ["CAP_SYS_ADMIN"]}}, "/agent/extraCapabilities/0"),
    ({"agent": {"hostPaths": {"cgroup": "sys/fs/cgroup"}}}, "/agent/hostPaths/cgroup"),
    ({"agent": {"dataDir": "var/lib/ingero"}}, "/agent/dataDir"),
    ({"agent": {"listenAddress": "localhost"}}, "/agent/listenAddress"),
    ({"agent": {"privilegd": True}}, "/agent"),
    ({"operator": {"replicas": -1}}, "/operator/replicas"),
    ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"refreshIntervalSeconds": 0}}, "/operator/refreshIntervalSeconds"),
    ({"operator": {"liveWindowSeconds": -1}}, "/operator/liveWindowSeconds"),
    ({"token": {"value": "short"}}, "/token/value"),
    ({"tls": {"enabled": "yes"}}, "/tls/enabled"),
    ({"tls": {"generate": True}}, "/tls"),
    ({"tls": {"certManager": {"enabled": True, "issuer": "ca"}}}, "/tls/certManager"),
    ({"tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "Vault"}}}}, "/tls/certManager/issuerRef/kind"),
    ({"tls": {"certManager": {"duration": "1 year"}}}, "/tls/certManager/duration"),
    ({"tls": {"validityDays": 0}}, "/tls/validityDays"),
    ({"networkPolicy": {"enable": False}}, "/networkPolicy"),
    ({"networkPolicy": {"metricsFrom": [{"podSelector": {"app": "prometheus"}}]}}, "/networkPolicy/metricsFrom/0"),
    ({"networkPolicy": {"artifactFrom": [{}]}}, "/networkPolicy/artifactFrom/0"),
    ({"networkPolicy": {"artifactFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "exclude": []}}]}},
     "/networkPolicy/artifactFrom/0/ipBlock"),
    ({"networkPolicy": {"extraOperatorIngress": [{"from": [], "port": 8443}]}}, "/networkPolicy/extraOperatorIngress/0"),
    ({"agent": {"tolerations": [{"key": "a", "operator": "Maybe"}]}}, "/agent/tolerations/0/operator"),
])
def test_values_schema_rejects_bad_values_and_the_render_fails(values, where):
    with pytest.raises(helm().HelmValuesError) as e:
        render(values)
    assert where in str(e.value)


def test_every_value_is_documented_with_a_helm_docs_comment_and_known_to_the_schema():
    lines = (CHART / "values.yaml").read_text().splitlines()
    values = yaml.safe_load("\n".join(lines))
    # Key paths whose line follows a `# --` comment block (helm-docs: a comment on a map
    # documents the whole map, e.g. resources).
    documented, stack = set(), []
    for i, ln in enumerate(lines):
        s = ln.strip()
        if not s or s.startswith("#") or s.startswith("- ") or ":" not in s:
            continue
        stack = stack[:(len(ln) - len(ln.lstrip())) // 2] + [s.split(":", 1)[0]]
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        if j >= 0 and lines[j].strip().startswith("# --"):
            documented.add(tuple(stack))

    def values_of(d, prefix=()):
        for k, v in d.items():
            path = prefix + (k,)
            if path in documented or not (isinstance(v, dict) and v):
                yield path
            else:
                yield from values_of(v, path)

    paths = list(values_of(values))
    assert [".".join(p) for p in paths if p not in documented] == []
    assert len(paths) > 40
    # ... and the schema knows every value (additionalProperties is false throughout).
    schema = helm().Chart.load(str(CHART)).schema
    for path in paths:
        node = schema
        for k in path:
            assert k in node.get("properties", {}), f"values.schema.json lacks {'.'.join(path)}"
            node = node["properties"][k]


# ---- the generated token ---------------------------------------------------------------

def test_generated_token_is_random_and_kept_across_upgrades_by_lookup(tmp_path):
    pytest.importorskip("kmock", reason="kmock (the embedded API server) is not installed")
    from ingero_operator.embedded import EmbeddedCluster

    def token(files):
        doc = yaml.safe_load(files[f"{RELEASE}/templates/secret.yaml"])
        return base64.b64decode(doc["data"]["token"]).decode()

    first, second = token(render_files()), token(render_files())
    assert first != second and len(first) == 64 and first.isalnum()
    cluster = EmbeddedCluster(CHART / "crds" / "tracesession.yaml", tmp_path).start()
    try:
        fresh = token(render_files(kubeconfig=cluster.kubeconfig))   # nothing to look up: new token
        assert len(fresh) == 64
        secret = yaml.safe_load(render_files(values={"token": {"value": "k" * 40}})
                                [f"{RELEASE}/templates/secret.yaml"])
        cluster.create(f"/api/v1/namespaces/{NAMESPACE}/secrets", secret)
        # An upgrade without token.value keeps the installed token (lookup), twice in a row.
        assert token(render_files(kubeconfig=cluster.kubeconfig, upgrade=True)) == "k" * 40
        assert token(render_files(kubeconfig=cluster.kubeconfig, upgrade=True)) == "k" * 40
        # A token given explicitly wins.
        assert token(render_files({"token": {"value": "n" * 20}}, kubeconfig=cluster.kubeconfig,
                                  upgrade=True)) == "n" * 20
    finally:
        cluster.stop()


def test_notes_tell_how_to_check_the_agents_and_warn_about_emptydir_artifacts():
    notes = render_files()[f"{RELEASE}/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} get pods -l app.kubernetes.io/component=agent" in notes
    assert "emptyDir" in notes
    assert "emptyDir" not in render_files(NON_DEFAULT)[f"{RELEASE}/templates/NOTES.txt"]
    assert shlex.split("kubectl apply -f examples/tracesession.yaml")[-1] in notes


def test_escape_hatches_reach_both_pods_and_the_schema_guards_them(tmp_path):
    docs = render(NON_DEFAULT)
    for kind, name in (("Deployment", "operator"), ("DaemonSet", "agent")):
        obj = next(d for d in docs if d["kind"] == kind)
        pod = obj["spec"]["template"]
        c = container(docs, kind, name)
        assert pod["metadata"]["labels"]["team"] == "ml-infra"
        assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == name   # selector labels kept
        assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in c["env"]
        assert {"name": "site-ca", "mountPath": "/etc/site-ca", "readOnly": True} in c["volumeMounts"]
        assert {"name": "site-ca", "configMap": {"name": "site-ca"}} in pod["spec"]["volumes"]
        assert c["args"][-1] == ("--verbose" if name == "operator" else "--quiet")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert ds["spec"]["template"]["spec"]["securityContext"] == {"seLinuxOptions": {"type": "spc_t"}}
    assert next(d for d in render() if d["kind"] == "DaemonSet")["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    for bad in ({"agent": {"podLabels": {"app.kubernetes.io/component": "x"}}},
                {"operator": {"extraArgs": ["verbose"]}},
                {"agent": {"extraVolumeMounts": [{"name": "x", "mountPath": "relative"}]}},
                {"agent": {"updateStrategy": {"type": "Sometimes"}}}):
        with pytest.raises(Exception, match="values.schema|schema"):
            render(bad)
