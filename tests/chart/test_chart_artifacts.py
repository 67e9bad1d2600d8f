"""The chart's artifact objects: the operator Service's `artifacts` port, the flags that make the
operator serve it and name it in status, and the artifact-reader ClusterRole, whose one rule must
name the proxy id clients use (tests/unit/test_kubectl_plugin.py checks the plugin's real calls)."""

from __future__ import annotations

import pytest

from tests.chart.chartlib import NAMESPACE, args_of, container, find, helm, render, render_files


def test_by_default_the_operator_serves_artifacts_behind_its_service_port_named_artifacts():
    from ingero.cli import build_parser

    docs = render()
    op = container(docs, "Deployment", "operator")
    svc = find(docs, "Service", "ingero-operator")
    assert svc["metadata"]["namespace"] == NAMESPACE
    assert svc["spec"]["ports"] == [{"name": "artifacts", "port": 8082, "targetPort": "artifacts", "protocol": "TCP"}]
    pod = find(docs, "Deployment")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == find(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert {"name": "artifacts", "containerPort": 8082, "protocol": "TCP"} in op["ports"]
    a = build_parser().parse_args(op["args"])
    assert (a.artifact_port, a.artifact_address) == (8082, "0.0.0.0")
    assert a.artifact_service == "ingero-operator:artifacts"     # status.artifact.proxy names this Service


def test_the_reader_role_grants_get_on_the_proxy_of_that_service_port_only():
    role = find(render(), "ClusterRole", "ingero-artifact-reader")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["services/proxy"],
                              "resourceNames": ["ingero-operator:artifacts"], "verbs": ["get"]}]
    assert "rbac.authorization.k8s.io/aggregate-to-view" not in role["metadata"]["labels"]
    agg = find(render({"operator": {"artifacts": {"aggregateToView": True}}}), "ClusterRole", "ingero-artifact-reader")
    assert agg["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"


def test_a_namespaced_install_gets_a_role_in_the_release_namespace_and_no_aggregation():
    docs = render({"operator": {"watchNamespaces": ["team-a"]}})
    role = find(docs, "Role", "ingero-artifact-reader")
    assert role["metadata"]["namespace"] == NAMESPACE and role["rules"][0]["resourceNames"] == \
        ["ingero-operator:artifacts"]
    with pytest.raises(helm().HelmRenderError, match="aggregateToView needs a ClusterRole"):
        render({"operator": {"watchNamespaces": ["team-a"], "artifacts": {"aggregateToView": True}}})


def test_names_and_port_follow_the_release_and_values():
    docs = render({"operator": {"artifacts": {"port": 9000}}}, name="team")
    svc, role = find(docs, "Service", "team-ingero-operator"), find(docs, "ClusterRole", "team-ingero-artifact-reader")
    assert svc["spec"]["ports"][0]["port"] == 9000 and svc["spec"]["ports"][0]["name"] == "artifacts"
    assert role["rules"][0]["resourceNames"] == ["team-ingero-operator:artifacts"]
    args = args_of(container(docs, "Deployment", "operator"))
    assert args["--artifact-port"] == ["9000"] and args["--artifact-service"] == ["team-ingero-operator:artifacts"]


def test_serve_false_renders_no_service_role_port_or_flag():
    docs = render({"operator": {"artifacts": {"serve": False}}})
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not kinds & {("Service", "ingero-operator"), ("ClusterRole", "ingero-artifact-reader")}
    op = container(docs, "Deployment", "operator")
    assert not any(a.startswith("--artifact-") for a in op["args"])
    assert all(p["name"] != "artifacts" for p in op["ports"])


def test_the_operator_caps_what_a_node_and_a_session_may_send_under_the_artifact_cap():
    from ingero.cli import build_parser

    a = build_parser().parse_args(container(render(), "Deployment", "operator")["args"])
    assert a.node_max_bytes < a.session_max_bytes < a.artifacts_max_bytes
    a = build_parser().parse_args(container(render({"operator": {"artifacts": {
        "nodeMaxBytes": 5 << 30, "sessionMaxBytes": 50 << 30}}}), "Deployment", "operator")["args"])
    assert (a.node_max_bytes, a.session_max_bytes) == (5 << 30, 50 << 30)


@pytest.mark.parametrize("values,where", [
    ({"operator": {"artifacts": {"nodeMaxBytes": 0}}}, "/operator/artifacts/nodeMaxBytes"),
    ({"operator": {"artifacts": {"port": 0}}}, "/operator/artifacts/port"),
    ({"operator": {"artifacts": {"port": "8082"}}}, "/operator/artifacts/port"),
    ({"operator": {"artifacts": {"serve": "yes"}}}, "/operator/artifacts/serve"),
])
def test_values_schema_rejects_bad_artifact_values(values, where):
    with pytest.raises(helm().HelmValuesError) as e:
        render(values)
    assert where in str(e.value)


def test_notes_say_how_to_read_artifacts_and_warn_about_replicas_without_a_shared_claim():
    notes = render_files()["ingero/templates/NOTES.txt"]
    assert "kubectl ingero report <session>" in notes and "--clusterrole=ingero-artifact-reader" in notes
    assert "keeps its own artifacts" not in notes
    many = render_files({"operator": {"replicas": 2}})["ingero/templates/NOTES.txt"]
    assert "With 2 operator replicas and no operator.artifacts.existingClaim" in many
    off = render_files({"operator": {"artifacts": {"serve": False}}})["ingero/templates/NOTES.txt"]
    assert "kubectl ingero" not in off
