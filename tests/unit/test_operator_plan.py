"""Operator planning without a cluster: spec checks, pods to per-node plans, agent discovery."""

from __future__ import annotations

import re

import pytest

from ingero_operator.plan import (SpecError, agent_endpoints, group_by_node, label_selector, node_plan,
                                  parse_spec, pod_entry, pod_finished, session_id)


def pod(name, node, uid=None, phase="Running", cid="abc123", ips=("10.0.0.1",), labels=None):
    return {"metadata": {"name": name, "namespace": "ml", "uid": uid or f"uid-{name}", "labels": labels or {}},
            "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "podIP": ips[0] if ips else None, "podIPs": [{"ip": i} for i in ips],
                       "containerStatuses": [{"name": "trainer", "containerID": f"containerd://{cid}"}] if cid else []}}


def test_spec_defaults_to_all_probes_and_open_ended():
    s = parse_spec({"selector": {"matchLabels": {"job-name": "j"}}})
    assert s.probes == ("nccl", "tcp", "sched") and s.duration_s is None and s.match_labels == {"job-name": "j"}


@pytest.mark.parametrize("spec,field", [
    ({}, "spec.selector.matchLabels"), ({"selector": {"matchLabels": {}}}, "spec.selector.matchLabels"),
    ({"selector": {"matchLabels": {"a": "b"}}, "probes": ["gpu"]}, "spec.probes[0]"),
    ({"selector": {"matchLabels": {"a": "b"}}, "probes": []}, "spec.probes"),
    ({"selector": {"matchLabels": {"a": "b"}}, "durationSeconds": -1}, "spec.durationSeconds"),
    ({"selector": {"matchLabels": {"a": "b"}}, "durationSeconds": 1.5}, "spec.durationSeconds"),
    ({"selector": {"matchLabels": {"a": "b"}}, "thresholds": {"schedMinMicros": -3}}, "spec.thresholds.schedMinMicros"),
    ({"selector": {"matchLabels": {"a": "b"}}, "rdmaSeconds": 0.05}, "spec.rdmaSeconds must be 0 (off) or at least 0.1"),
    ({"selector": {"matchLabels": {"a": "b"}}, "rdmaSeconds": 7200}, "spec.rdmaSeconds"),
    ({"selector": {"matchLabels": {"a": "b"}}, "ncclLibPath": "lib/x.so"}, "spec.ncclLibPath"),
    ({"selector": {"matchLabels": {"a": "b"}}, "ncclLibPath": "/lib/x.so\nLD_PRELOAD=/tmp/y"}, "spec.ncclLibPath"),
    ({"selector": {"matchLabels": {"a": "bad value!"}}}, "spec.selector.matchLabels.a"),
    ({"selector": {"matchLabels": {"bad key!": "b"}}}, "'bad key!' is not a valid label key"),
    ({"selector": {"matchLabels": {"Example.com/a": "b"}}}, "'Example.com/a' is not a valid label key"),
    ({"selector": {"matchLabels": {"a" * 64: "b"}}}, "is not a valid label key"),
    ({"selector": {"matchLabels": {f"k{i}": "v" for i in range(5000)}}}, "has 5000 labels; at most 64")])
def test_bad_specs_are_refused_naming_the_field(spec, field):
    with pytest.raises(SpecError, match=re.escape(field)):
        parse_spec(spec)


def test_label_keys_with_a_prefix_and_the_longest_names_are_taken():
    labels = {"app.kubernetes.io/name": "x", "job-name": "", "a" * 63: "v" * 63, "ingero.io/profiler": "A_b.c-1"}
    assert parse_spec({"selector": {"matchLabels": labels}}).match_labels == labels


def test_pod_entry_carries_uid_container_ids_and_ips_for_the_agent():
    e = pod_entry(pod("w-0", "n1", ips=("10.0.0.1", "fd00::1")))
    assert e == {"name": "w-0", "namespace": "ml", "uid": "uid-w-0", "node": "n1",
                 "containers": [{"name": "trainer", "id": "containerd://abc123"}], "ips": ["10.0.0.1", "fd00::1"]}
    assert pod_entry(pod("w-1", "n1", cid=None))["containers"] == []   # not started yet: the uid is enough


def test_pods_are_grouped_by_node_and_unscheduled_ones_reported():
    by_node, unscheduled = group_by_node([pod("w-1", "n2"), pod("w-0", "n1"), pod("w-2", "n2"), pod("w-3", None)])
    assert {n: [e["name"] for e in es] for n, es in by_node.items()} == {"n1": ["w-0"], "n2": ["w-1", "w-2"]}
    assert unscheduled == ["w-3"]


def test_agents_are_found_by_node_from_pod_ip_and_the_named_port():
    agents = [
        {"spec": {"nodeName": "n1", "containers": [{"ports": [{"name": "metrics", "containerPort": 1},
                                                              {"name": "api", "containerPort": 9464}]}]},
         "status": {"phase": "Running", "podIP": "10.1.0.5"}},
        {"spec": {"nodeName": "n2", "containers": [{"ports": [{"name": "api", "containerPort": 9464}]}]},
         "status": {"phase": "Pending"}},
    ]
    assert agent_endpoints(agents, "api") == {"n1": ("10.1.0.5", 9464)}


def test_node_plan_has_what_the_agent_api_takes():
    spec = parse_spec({"selector": {"matchLabels": {"a": "b"}}, "probes": ["nccl", "sched"],
                       "ncclLibPath": "/opt/nccl/libnccl.so.2", "thresholds": {"schedMinMicros": 500},
                       "rdmaSeconds": 0})
    body = node_plan("ml.job.1234abcd", [pod_entry(pod("w-0", "n1"))], spec, duration_s=30.0)
    assert body["session_id"] == "ml.job.1234abcd" and body["probes"] == ["nccl", "sched"]
    assert body["nccl_lib"] == "/opt/nccl/libnccl.so.2" and body["sched_min_us"] == 500.0
    assert body["rdma_s"] == 0.0
    assert body["duration_s"] == 30.0 and body["pods"][0]["uid"] == "uid-w-0"


def test_session_ids_are_stable_and_safe_for_the_agent():
    from ingero_agent.api import check_session_id
    sid = session_id("ml", "my_job", "0f1e2d3c-aaaa-bbbb")
    assert sid == session_id("ml", "my_job", "0f1e2d3c-aaaa-bbbb") == "ml.my_job.0f1e2d3c"
    assert check_session_id(session_id("a/b", "x y", ".."))


def test_finished_pods_and_selectors():
    assert pod_finished(pod("a", "n", phase="Succeeded")) and not pod_finished(pod("a", "n"))
    assert label_selector({"b": "2", "a": "1"}) == "a=1,b=2"


@pytest.mark.parametrize("field,value", [
    ("durationSeconds", 10 ** 12), ("durationSeconds", 2 ** 63 - 1), ("durationSeconds", 2592001)])
def test_a_number_past_its_maximum_is_a_spec_error_naming_the_range(field, value):
    with pytest.raises(SpecError, match=f"spec.{field} must be between 1 and 2592000"):
        parse_spec({"selector": {"matchLabels": {"a": "b"}}, field: value})


def test_thresholds_past_their_maximum_are_spec_errors():
    with pytest.raises(SpecError, match="slowCollectiveMs must be between 0 and 3600000"):
        parse_spec({"selector": {"matchLabels": {"a": "b"}}, "thresholds": {"slowCollectiveMs": 1e400}})
