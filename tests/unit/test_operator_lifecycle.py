"""A TraceSession's whole lifecycle as conditions and Events, with the real operator.

The real kopf operator (`ingero operator run`) against the embedded API server
(the flow of tests/unit/operator_flow.py),
real agent HTTP servers on two nodes (their tracer is tests/unit/fake_tracer.py,
which writes a job whose rank 3 arrives late at every all-reduce: its own work, so
the cause is compute/unknown; its retransmits fall after it arrived), a third node whose
agent does not answer, and the real kubectl for `wait`, `describe` and
`get -o wide`. No root, no eBPF.

    Pending (WaitingForPods) -> Running (Tracing) -> Gathering -> Completed (+ StragglerDetected)
    Pending -> Failed (NoPods); Failed at once (InvalidSpec); Pending (AgentUnreachable)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from ingero_operator.status import CONDITION_TYPES, lifecycle, now_iso
from tests.unit.operator_flow import PODS, TRS, started
from tests.unit.trace_fixture import TOKEN

REQUIRED = {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    # --artifacts-max-bytes 1: every completion deletes the older merged traces (the retention test)
    yield from started(tmp_path_factory, "lifecycle", operator_args=("--artifacts-max-bytes", "1"))


def conds(st: dict) -> dict[str, dict]:
    return {c["type"]: c for c in st.get("conditions") or []}


def shape_ok(st: dict, generation: int = 1) -> dict[str, dict]:
    """Every lifecycle condition present, metav1.Condition-shaped."""
    cs = conds(st)
    assert sorted(cs) == sorted(CONDITION_TYPES), cs
    for c in cs.values():
        assert REQUIRED <= c.keys() and c["status"] in ("True", "False", "Unknown") and c["reason"].isalnum(), c
        assert c["observedGeneration"] == generation and c["lastTransitionTime"].endswith("Z")
    return cs


def test_conditions_follow_the_lifecycle_with_frozen_transition_times(monkeypatch):
    """Unit: status.lifecycle alone, with the clock stepped at each transition."""
    import ingero_operator.status as status_mod
    clock = iter(f"2030-01-01T00:00:{s:02d}Z" for s in range(60))
    monkeypatch.setattr(status_mod, "now_iso", lambda: next(clock))
    pend = lifecycle("Pending", "WaitingForPods", "no pod", 1, None)
    run = lifecycle("Running", "Tracing", "tracing", 1, pend)
    strag = {"rank": 3, "pod": "w-3", "node": "n1", "cause": "cpu-contention", "savingPct": 12.25,
             "savingMsPerStep": 4.5}
    run2 = lifecycle("Running", "Tracing", "tracing", 1, run, strag)
    gat = lifecycle("Gathering", "Gathering", "gathering", 1, run2, strag)
    done = lifecycle("Completed", "Completed", "completed", 1, gat, strag)
    p, r, r2, g, d = (conds({"conditions": x}) for x in (pend, run, run2, gat, done))
    assert [x["Tracing"]["status"] for x in (p, r, r2, g, d)] == ["False", "True", "True", "False", "False"]
    assert p["Tracing"]["reason"] == "WaitingForPods" and d["Tracing"]["reason"] == "Finished"
    assert [x["Ready"]["status"] for x in (p, r, r2, g, d)] == ["False"] * 4 + ["True"]
    assert [x["Completed"]["status"] for x in (p, r, r2, g, d)] == ["False"] * 4 + ["True"]
    # a time changes only with the status: Failed stayed False from Pending on
    assert d["Failed"]["lastTransitionTime"] == p["Failed"]["lastTransitionTime"]
    assert r2["Tracing"]["lastTransitionTime"] == r["Tracing"]["lastTransitionTime"] != p["Tracing"]["lastTransitionTime"]
    assert g["Tracing"]["lastTransitionTime"] == d["Tracing"]["lastTransitionTime"] != r["Tracing"]["lastTransitionTime"]
    assert r["StragglerDetected"]["status"] == "Unknown" and r2["StragglerDetected"]["status"] == "True"
    assert d["StragglerDetected"]["lastTransitionTime"] == r2["StragglerDetected"]["lastTransitionTime"]
    assert d["StragglerDetected"]["reason"] == "CpuContention"
    assert d["StragglerDetected"]["message"] == ("rank 3 (pod w-3, node n1) is the straggler: cause cpu-contention; "
                                                 "saving 12.2% of step time (4.50 ms/step)")
    clean = conds({"conditions": lifecycle("Completed", "Completed", "done", 2, gat)})
    assert clean["StragglerDetected"]["status"] == "False" and clean["StragglerDetected"]["reason"] == "NoStraggler"
    assert clean["Tracing"]["observedGeneration"] == 2
    failed = conds({"conditions": lifecycle("Failed", "MergeFailed", "merging failed", 1, gat, strag)})
    assert (failed["Failed"]["status"], failed["Failed"]["reason"]) == ("True", "MergeFailed")
    assert (failed["Ready"]["status"], failed["Completed"]["status"]) == ("False", "False")
    with pytest.raises(ValueError):
        lifecycle("Exploded", None, "", 1, None)
    assert now_iso().endswith("Z")


def test_bad_sessions_fail_with_their_reason_in_conditions_events_and_the_wide_columns(flow):
    # refused by the operator (the CRD schema lets it through): Failed at once
    flow.apply("bad-lib", selector={"matchLabels": {"job-name": "none", "bad key!": "x"}})
    st = flow.wait_for("bad-lib", lambda s: s.get("phase") == "Failed")
    cs = shape_ok(st)
    assert (cs["Failed"]["status"], cs["Failed"]["reason"]) == ("True", "InvalidSpec")
    assert (cs["Ready"]["status"], cs["Completed"]["status"], cs["Tracing"]["status"]) == ("False", "False", "False")
    assert "spec.selector.matchLabels: 'bad key!' is not a valid label key" in cs["Failed"]["message"] \
        == st["message"]
    ev = [e for e in flow.wait_events("bad-lib", {"Failed"}) if e["reason"] == "Failed"]
    assert ev[0]["type"] == "Warning" and "label key" in ev[0]["message"]
    wide = flow.kubectl("get", "tracesession", "bad-lib", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-1] == "MESSAGE" and wide[1].split()[1] == "Failed"
    assert wide[1].endswith(st["message"])

    # no pod within durationSeconds: Pending (WaitingForPods), then Failed (NoPods)
    flow.apply("no-pods", selector={"matchLabels": {"job-name": "nobody"}}, durationSeconds=2)
    pend = shape_ok(flow.wait_for("no-pods", lambda s: s.get("phase") == "Pending"))
    assert (pend["Tracing"]["status"], pend["Tracing"]["reason"]) == ("False", "WaitingForPods")
    assert pend["StragglerDetected"]["status"] == "Unknown" and pend["Ready"]["status"] == "False"
    st = flow.wait_for("no-pods", lambda s: s.get("phase") == "Failed", timeout=30)    # looked at again quietly
    cs = shape_ok(st)
    assert (cs["Failed"]["status"], cs["Failed"]["reason"]) == ("True", "NoPods")
    assert cs["Failed"]["lastTransitionTime"] >= pend["Failed"]["lastTransitionTime"]
    assert cs["Tracing"]["lastTransitionTime"] == pend["Tracing"]["lastTransitionTime"]   # False all along
    assert "within durationSeconds (2)" in st["message"]
    flow.wait_events("no-pods", {"Failed"})


def test_an_unreachable_agent_keeps_the_session_pending_with_a_warning(flow):
    flow.rank_pod("job-c", 0, "node-c")
    flow.apply("unreach", selector={"matchLabels": {"job-name": "job-c"}})
    st = flow.wait_for("unreach", lambda s: conds(s).get("Tracing", {}).get("reason") == "AgentUnreachable")
    cs = shape_ok(st)
    assert st["phase"] == "Pending" and cs["Tracing"]["status"] == "False" and cs["Ready"]["status"] == "False"
    ev = [e for e in flow.wait_events("unreach", {"AgentUnreachable"}) if e["reason"] == "AgentUnreachable"]
    assert ev[0]["type"] == "Warning" and ev[0]["message"].startswith("node node-c:")
    time.sleep(6)   # the operator retries (5 s): the same node still down posts no second warning
    assert len([e for e in flow.events("unreach") if e["reason"] == "AgentUnreachable"]) == 1
    # ... and logs the wait once, at INFO, not an error per look
    log = (flow.tmp / "operator.log").read_text()
    assert log.count("default/unreach: pending (AgentUnreachable)") == 1, log[-3000:]
    assert "failed temporarily" not in log, log[-3000:]


def test_a_session_goes_pending_tracing_completed_and_kubectl_wait_returns_with_the_verdict(flow):
    flow.apply("job-trace", selector={"matchLabels": {"job-name": "job1"}})
    pend = shape_ok(flow.wait_for("job-trace", lambda s: s.get("phase") == "Pending"))
    assert (pend["Tracing"]["status"], pend["Tracing"]["reason"]) == ("False", "WaitingForPods")
    waiter = subprocess.Popen(["kubectl", "wait", "--for=condition=Completed", "tracesession/job-trace",
                               "--timeout=120s"], env=flow.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        pods = [flow.rank_pod("job1", r, "node-a" if r < 2 else "node-b") for r in range(4)]

        def never_ready_while_tracing(s):
            c = conds(s)
            if s.get("phase") in ("Pending", "Running", "Gathering"):
                assert c.get("Ready", {}).get("status") != "True" and c.get("Completed", {}).get("status") != "True"

        run = flow.wait_for("job-trace", lambda s: s.get("phase") == "Running", every=never_ready_while_tracing)
        cs = shape_ok(run)
        assert (cs["Tracing"]["status"], cs["Tracing"]["reason"]) == ("True", "Tracing")
        assert cs["Failed"]["lastTransitionTime"] == pend["Failed"]["lastTransitionTime"]
        live = flow.wait_for("job-trace", lambda s: conds(s)["StragglerDetected"]["status"] == "True",
                             every=never_ready_while_tracing)
        assert live["phase"] == "Running" and live["straggler"]["rank"] == 3
        assert waiter.poll() is None, "kubectl wait returned while the session was tracing"
        for p in pods:    # the job ends
            flow.cluster.patch(f"{PODS}/{p['metadata']['name']}/status", {"status": {"phase": "Succeeded"}})
        out, err = waiter.communicate(timeout=90)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert out.strip() == "tracesession.ingero.io/job-trace condition met"
    st = flow.status("job-trace")          # what kubectl wait saw: the verdict is in
    cs = shape_ok(st)
    assert st["phase"] == "Completed" and st["straggler"]["rank"] == 3 and st["straggler"]["cause"] == "compute/unknown"
    assert (cs["Completed"]["status"], cs["Ready"]["status"], cs["Ready"]["reason"]) == ("True", "True", "VerdictReady")
    assert (cs["Tracing"]["status"], cs["Tracing"]["reason"], cs["Failed"]["status"]) == ("False", "Finished", "False")
    assert (cs["StragglerDetected"]["status"], cs["StragglerDetected"]["reason"]) == ("True", "ComputeUnknown")
    assert (cs["Judged"]["status"], cs["Judged"]["reason"], cs["Hung"]["status"]) == ("True", "Judged", "False")
    assert st["verdict"] == {"kind": "straggler", "who": st["straggler"]["who"]} and st.get("hang") is None
    # the pod as the trace names it (fake_tracer writes trace_fixture's job: job-rank-<r>)
    assert cs["StragglerDetected"]["message"].startswith("rank 3 (pod job-rank-3, node node-b) is the straggler")
    assert cs["StragglerDetected"]["lastTransitionTime"] == conds(live)["StragglerDetected"]["lastTransitionTime"]
    assert cs["Failed"]["lastTransitionTime"] == pend["Failed"]["lastTransitionTime"]

    evs = flow.wait_events("job-trace", {"Tracing", "StragglerDetected", "Gathered", "Completed"})
    order = [e["reason"] for e in evs]
    assert order.index("Tracing") < order.index("StragglerDetected") < order.index("Gathered") \
        < order.index("Completed"), order
    types = {e["reason"]: e["type"] for e in evs}
    assert types == {"Tracing": "Normal", "StragglerDetected": "Warning", "Gathered": "Normal",
                     "Completed": "Normal"}, [(e["type"], e["reason"], e["message"]) for e in evs]
    assert order.count("Tracing") == 1 and order.count("StragglerDetected") == 1   # no repeats per refresh
    strag = next(e for e in evs if e["reason"] == "StragglerDetected")["message"]
    assert "rank 3" in strag and "cause compute/unknown" in strag and "% of step time" in strag
    assert "gathered 2/2 nodes" in next(e for e in evs if e["reason"] == "Gathered")["message"]
    assert all(e["involvedObject"]["uid"] == flow.cluster.get(f"{TRS}/job-trace")["metadata"]["uid"] for e in evs)
    assert {(e["source"]["component"], e["reportingComponent"]) for e in evs} == {("ingero-operator",) * 2}

    described = flow.kubectl("describe", "tracesession", "job-trace").stdout
    events = described.split("\nEvents:", 1)[1]
    for reason in ("Normal   Tracing", "Warning  StragglerDetected", "Normal   Gathered", "Normal   Completed"):
        assert reason in events, described
    assert "ingero-operator" in events and "kopf" not in events, described
    # kopf's per-refresh success line (every 0.5 s here) is debug-level noise (cli.quiet_timers)
    assert "Timer 'refresh' succeeded" not in (flow.tmp / "operator.log").read_text()
    assert "Failed" not in events
    assert flow.operator.poll() is None, "the operator stopped"


def test_a_running_session_whose_spec_is_edited_into_a_refused_one_fails_and_stops_tracing(flow):
    flow.rank_pod("job2", 0, "node-a")
    flow.apply("edited", selector={"matchLabels": {"job-name": "job2"}})
    run = flow.wait_for("edited", lambda s: s.get("phase") == "Running", timeout=30)
    flow.kubectl("patch", "tracesession", "edited", "--type=merge", "-p",
                 '{"spec": {"selector": {"matchLabels": {"bad key!": "x"}}}}')
    st = flow.wait_for("edited", lambda s: s.get("phase") == "Failed", timeout=30)
    cs = shape_ok(st, generation=2)
    assert (cs["Failed"]["status"], cs["Failed"]["reason"]) == ("True", "InvalidSpec")
    assert (cs["Tracing"]["status"], cs["Tracing"]["reason"]) == ("False", "Failed")
    assert cs["Tracing"]["lastTransitionTime"] >= conds(run)["Tracing"]["lastTransitionTime"]
    assert "'bad key!' is not a valid label key" in st["message"]
    assert [e["type"] for e in flow.wait_events("edited", {"Failed"}) if e["reason"] == "Failed"] == ["Warning"]
    agent = flow.agents[0]   # node-a's agent was told to stop
    sid = st["sessionId"]
    req = urllib.request.Request(f"http://127.0.0.1:{agent.server_address[1]}/v1/sessions/{sid}",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["state"] == "stopped"


def _complete(flow, name: str, job: str, **spec) -> tuple[dict, str]:
    """Run a session of a 2-pod job on node-a to completion: (its status, its uid)."""
    pods = [flow.rank_pod(job, r, "node-a") for r in (0, 1)]
    flow.apply(name, selector={"matchLabels": {"job-name": job}}, **spec)
    uid = flow.cluster.get(f"{TRS}/{name}")["metadata"]["uid"]
    flow.wait_for(name, lambda s: s.get("phase") == "Running", timeout=30)
    for p in pods:
        flow.cluster.patch(f"{PODS}/{p['metadata']['name']}/status", {"status": {"phase": "Succeeded"}})
    return flow.wait_for(name, lambda s: s.get("phase") == "Completed", timeout=60), uid


def test_retention_the_artifact_cap_deletes_the_oldest_trace_and_the_ttl_deletes_the_session(flow):
    first, _ = _complete(flow, "keep-a", "job-ka")
    # the job has 4 ranks (WORLD_SIZE), the session traced the 2 on node-a: a partial verdict says so
    assert first["verdict"] == {"kind": "none", "who": "none", "coveredRanks": [0, 1]}, first["verdict"]
    judged = conds(first)["Judged"]
    assert (judged["status"], judged["reason"], judged["message"]) == (
        "True", "PartialRanks", "the verdict covers ranks 0-1 only")
    assert conds(first)["StragglerDetected"]["reason"] == "NoStraggler"
    old = Path(first["artifact"]["path"]).parent
    assert (old / "trace.duckdb").is_file() and (old / "owner.json").is_file()
    second, uid_b = _complete(flow, "ttl-b", "job-tb", ttlSecondsAfterFinished=1)
    new = Path(second["artifact"]["path"]).parent
    # --artifacts-max-bytes 1: the newer completion deleted the older trace and said so
    st = flow.wait_for("keep-a", lambda s: (s.get("artifact") or {}).get("deleted") is True, timeout=20)
    assert st["phase"] == "Completed" and not old.exists()
    ev = [e for e in flow.wait_events("keep-a", {"ArtifactExpired"}) if e["reason"] == "ArtifactExpired"]
    assert "--artifacts-max-bytes" in ev[0]["message"] and "oldest" in ev[0]["message"]
    # ttlSecondsAfterFinished 1: the session and its trace are gone within a few timer periods
    deadline = time.monotonic() + 20
    while flow.cluster.get(f"{TRS}/ttl-b") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not flow.cluster.get(f"{TRS}/ttl-b"), f"ttl-b still exists\n{flow.operator_log()}"
    assert not new.exists()
    deleted = [e for e in flow.events("ttl-b") if e["reason"] == "Deleted"]
    assert deleted and "ttlSecondsAfterFinished (1)" in deleted[0]["message"], flow.events("ttl-b")
    assert deleted[0]["involvedObject"]["uid"] == uid_b
    assert flow.cluster.get(f"{TRS}/keep-a"), "a session without a TTL stays"
    assert flow.operator.poll() is None


def test_the_artifact_cap_deletes_oldest_first_and_never_the_newest(tmp_path):
    from ingero_operator.session import Controller
    from ingero_operator.settings import Settings

    s = Settings(artifacts_dir=tmp_path, artifacts_max_bytes=2500)
    folders = []
    for i, name in enumerate(("a", "b", "c", "d")):
        root = tmp_path / "ns" / f"{name}-0000000{i}"
        root.mkdir(parents=True)
        (root / "trace.duckdb").write_bytes(b"x" * 1000)
        (root / "owner.json").write_text(json.dumps({"namespace": "ns", "name": name, "uid": f"u{i}"}))
        os.utime(root / "owner.json", (1_700_000_000 + i, 1_700_000_000 + i))
        folders.append(root)
    (tmp_path / "ns" / "stray").mkdir()         # no owner.json: not the operator's, never touched
    ctl = Controller(s, kube=None)
    gone = ctl.cap_artifacts(keep=folders[0])    # the "newest" here is the oldest by time: kept anyway
    assert [g["name"] for g in gone] == ["b", "c"] and all(g["bytes"] > 1000 for g in gone)
    assert [f.exists() for f in folders] == [True, False, False, True]
    assert (tmp_path / "ns" / "stray").is_dir()
    assert Controller(Settings(artifacts_dir=tmp_path), kube=None).cap_artifacts(keep=folders[3]) == []
