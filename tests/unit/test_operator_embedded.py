"""The embedded API server: admission by the CRD schema, metadata, status subresource, lists."""

from __future__ import annotations

import shutil
import subprocess
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
                                                   "straggler": {"who": "w-3", "pod": "w-3", "cause": "network"}}})
    out = subprocess.run(["kubectl", "get", "trs", "ok1"], env=env, capture_output=True, text=True, timeout=30)
    lines = [ln.split() for ln in out.stdout.splitlines()]
    assert lines[0] == ["NAME", "PHASE", "RANKS", "STRAGGLER", "CAUSE", "SLOWDOWN", "RETRANSMITS", "AGE"]
    assert lines[1][:7] == ["ok1", "Completed", "4", "w-3", "network", "7.5%", "12"]
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
