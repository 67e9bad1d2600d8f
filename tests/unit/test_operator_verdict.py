"""The verdict's kind on every surface of a TraceSession: status, conditions, the STRAGGLER
column, Events, metrics, `kubectl ingero trace` and `ingero report` (hand-built Reports
and Hangs: each kind, including the ones no trace of this test could produce yet)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml

from ingero.analysis import Hang, RankRow, Report, Straggler
from ingero.report_text import render
from ingero.session_follow import Lines, progress_line, verdict_line
from ingero_operator import metrics
from ingero_operator.session import Controller, Live, Ref
from ingero_operator.settings import GatherSettings, Settings
from ingero_operator.status import lifecycle, report_status, verdict_message
from ingero_operator.tables import table

ROOT = Path(__file__).resolve().parents[2]
WHY = "none of the 273 NCCL calls can be placed: 273 with an unknown communicator (comm_id_hash 0: ...)"


def rep(kind: str) -> Report:
    ranks = [RankRow(rank=i, node="n1", pod=f"w-{i}", pid=100 + i, collectives=40) for i in range(4)]
    r = Report(ranks=ranks, straggler=None, step_ms=50.0, collectives=160, retransmits=0, warnings=[])
    if kind == "cannot-judge":
        r.cannot_judge = WHY
    elif kind == "hang":
        r.hang = Hang(waiting=[{"rank": k, "op": "ALL_REDUCE", "comm": "0xabc", "seq": 812, "since_ns": 1}
                               for k in (0, 1, 3)], missing=[2], op="ALL_REDUCE", comm="0xabc", seq=812,
                      waited_s=40.0, evidence="ranks 0, 1, 3 wait in ALL_REDUCE #812 of 0xabc for 40 s; "
                                              "rank 2 never entered it")
    elif kind in ("straggler", "partial"):
        r.straggler = Straggler(rank=3, node="n1", pod="w-3", cause="network", score=1.0, evidence="e",
                                saving_ms_per_step=5.0, saving_pct=10.0)
        r.predicted_step_ms, r.mean_step_ms = 45.0, 50.0
        if kind == "partial":
            r.covered_ranks = [0, 1, 2, 3]
    return r


def status_of(r: Report) -> dict:
    return report_status(r, 4, GatherSettings())


def status(kind: str) -> dict:
    return status_of(rep(kind))


@pytest.mark.parametrize("kind,who,reason", [
    ("cannot-judge", "cannot judge", WHY), ("hang", "hang: rank 2", rep("hang").hang.evidence),
    ("straggler", "w-3", None), ("none", "none", None)])
def test_status_verdict_says_the_kind_and_the_column_never_stays_empty(kind, who, reason):
    st = status(kind)
    assert st["verdict"] == {"kind": kind, "who": who, "reason": reason, "coveredRanks": None}
    assert (st["straggler"] is None) == (kind != "straggler") and (st["hang"] is None) == (kind != "hang")
    crd = yaml.safe_load((ROOT / "crds" / "tracesession.yaml").read_text())
    cols = [c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"] if not c.get("priority")]
    row = table([{"metadata": {"name": "t"}, "status": {"phase": "Completed", **st}}], cols)["rows"][0]["cells"]
    assert row[[c["name"] for c in cols].index("Straggler") + 1] == who


def test_a_hang_is_in_status_bounded():
    h = status("hang")["hang"]
    assert h["missing"] == [2] and (h["op"], h["seq"], h["waitedS"]) == ("ALL_REDUCE", 812, 40.0)
    assert [w["rank"] for w in h["waiting"]] == [0, 1, 3]
    r = rep("hang")
    r.hang.waiting[0]["seq"] = None          # unknown: left out, never a null inside the list
    assert "seq" not in status_of(r)["hang"]["waiting"][0]


def conds(*args, **kw) -> dict:
    return {c["type"]: c for c in lifecycle(*args, **kw)}


def test_cannot_judge_is_judged_false_with_the_reason_and_never_no_straggler():
    c = conds("Completed", "Completed", "done", 1, None, None, status("cannot-judge")["verdict"])
    assert (c["Judged"]["status"], c["Judged"]["reason"], c["Judged"]["message"]) == ("False", "CannotJudge", WHY)
    assert (c["StragglerDetected"]["status"], c["StragglerDetected"]["reason"]) == ("Unknown", "CannotJudge")
    assert (c["Hung"]["status"], c["Hung"]["reason"], c["Ready"]["status"]) == ("Unknown", "CannotJudge", "True")


def test_a_hang_sets_hung_true_with_its_evidence_live_and_final():
    for phase in ("Running", "Completed"):
        c = conds(phase, "Tracing", "m", 1, None, None, status("hang")["verdict"])
        assert (c["Hung"]["status"], c["Hung"]["reason"]) == ("True", "Hang")
        assert c["Hung"]["message"].startswith("ranks 0, 1, 3 wait in ALL_REDUCE #812")
        assert c["StragglerDetected"]["status"] == "Unknown" and c["Judged"]["status"] == "True"


def test_judged_says_when_the_verdict_covers_part_of_the_job_and_is_unknown_before_any():
    st = status("partial")
    c = conds("Completed", "Completed", "done", 1, None, st["straggler"], st["verdict"])
    assert (c["Judged"]["status"], c["Judged"]["reason"]) == ("True", "PartialRanks")
    assert c["Judged"]["message"] == "the verdict covers ranks 0-3 only"
    none = conds("Completed", "Completed", "done", 1, None, None, status("none")["verdict"])
    assert (none["Judged"]["reason"], none["StragglerDetected"]["reason"]) == ("Judged", "NoStraggler")
    early = conds("Running", "Tracing", "m", 1, None)
    assert early["Judged"]["status"] == early["Hung"]["status"] == "Unknown"
    failed = conds("Failed", "MergeFailed", "m", 1, None, None, status("hang")["verdict"])
    assert failed["Judged"]["reason"] == failed["Hung"]["reason"] == "NoVerdict"


def test_events_name_a_hang_once_and_a_final_cannot_judge():
    c = Controller(Settings(), kube=None)
    posted = []
    c.event = lambda ref, type_, reason, message: posted.append((type_, reason, message))
    ref, live = Ref("ns", "t", "uid"), Live()
    for final in (False, False, True):      # two refreshes and the final verdict: one Event
        c._post_verdict(ref, live, status("hang")["verdict"], final)
    assert posted == [("Warning", "Hung", rep("hang").hang.evidence + " (live verdict)")]
    c._post_verdict(ref, live, status("cannot-judge")["verdict"], final=False)
    assert len(posted) == 1                 # live: the Judged condition says it
    c._post_verdict(ref, live, status("cannot-judge")["verdict"], final=True)
    assert posted[-1] == ("Warning", "CannotJudge", f"no verdict: {WHY}")
    assert verdict_message(status("cannot-judge")["verdict"], None) == f"cannot judge: {WHY}"
    assert verdict_message(status("none")["verdict"], None).startswith("no straggler")


def scrape() -> dict:
    return {tuple(s.labels.get(k) for k in ("namespace", "name", "verdict")): s.value
            for m in metrics.REGISTRY.collect() if m.name == "ingero_verdict" for s in m.samples}


def test_the_verdict_gauge_carries_the_kind_and_follows_it():
    metrics.observe("u-verdict", "ns", "t", status("cannot-judge"))
    assert scrape()[("ns", "t", "cannot-judge")] == 1
    metrics.observe("u-verdict", "ns", "t", status("hang"))
    assert ("ns", "t", "cannot-judge") not in scrape() and scrape()[("ns", "t", "hang")] == 1
    metrics.forget("u-verdict")
    assert not [k for k in scrape() if k[:2] == ("ns", "t")]


def test_kubectl_ingero_trace_prints_hang_and_cannot_judge_never_no_straggler():
    def st(kind, phase="Completed"):
        s = status(kind)
        return {"phase": phase, **s, "conditions": lifecycle(phase, phase, "m", 1, None, s["straggler"],
                                                              s["verdict"])}
    assert verdict_line(st("cannot-judge")) == f"cannot judge: {WHY}"
    assert verdict_line(st("hang")).startswith("hang: ranks 0, 1, 3 wait in ALL_REDUCE #812")
    assert verdict_line(st("partial")).endswith("(the verdict covers ranks 0-3 only)")
    assert verdict_line(st("none")).startswith("no straggler: ")
    lines = Lines(clock=lambda: 0.0)
    assert f"hang: {rep('hang').hang.evidence}" in lines.update(st("hang", "Running"))
    assert progress_line(st("cannot-judge", "Running")).endswith(f"cannot judge yet: {WHY}")


@pytest.mark.parametrize("kind,line", [
    ("cannot-judge", f"verdict: cannot judge: {WHY}"),
    ("hang", "verdict: hang: rank 2 holds up the ALL_REDUCE the others wait in"),
    ("partial", "verdict: straggler (covers ranks 0-3 only)"), ("none", "verdict: none")])
def test_ingero_report_prints_the_verdict_kind_and_a_hang_with_its_evidence(kind, line):
    out = io.StringIO()
    render(rep(kind), out)
    text = out.getvalue()
    assert line in text.splitlines()
    assert ("straggler: none" in text) == (kind == "none")
    assert (f"hang: {rep('hang').hang.evidence}" in text) == (kind == "hang")


def test_a_node_whose_selected_pods_sent_nothing_leaves_the_operator_unable_to_judge(tmp_path):
    from ingero_operator.gather import LocalSession, unheard

    local = LocalSession(tmp_path)
    (local.node_dir("node-a") / "nccl_events").mkdir(parents=True)
    rows = [{"name": "node-a", "pods": 2}, {"name": "node-b", "pods": 2}, {"name": "node-c", "pods": 0}]
    for kind in ("none", "straggler"):
        r = rep(kind)
        unheard(local, rows, r)
        assert r.verdict == "cannot-judge" and r.straggler is None
        assert r.cannot_judge == ("1 of 3 nodes with selected pods sent no data (node-b): their ranks may be the "
                                  "ones the others wait for")
    h = rep("hang")
    unheard(local, rows, h)
    assert h.verdict == "hang" and h.cannot_judge is None       # a hang stands: it names who is missing
    ok = rep("straggler")
    unheard(local, rows[:1] + rows[2:], ok)
    assert ok.verdict == "straggler"


def straggler_series() -> dict:
    return {(s.labels["namespace"], s.labels["name"]): (s.labels, s.value) for m in metrics.REGISTRY.collect()
            if m.name == "ingero_straggler_saving_ratio" for s in m.samples}


def test_a_stage_verdict_names_the_group_and_its_ranks_never_one_members_pod():
    stage = {"kind": "stage", "who": "stage 1 (ranks 4-7)", "ranks": [4, 5, 6, 7], "rank": 7, "pod": "job-rank-7",
             "cause": "compute", "savingPct": 12.5}
    metrics.observe("u-stage", "ns", "stage", {"phase": "Running", "straggler": stage})
    labels, value = straggler_series()[("ns", "stage")]
    assert {k: labels[k] for k in ("kind", "who", "ranks", "pod", "cause")} == {
        "kind": "stage", "who": "stage 1 (ranks 4-7)", "ranks": "4-7", "pod": "", "cause": "compute"}
    assert value == 0.125
    metrics.forget("u-stage")


def test_the_straggler_series_goes_when_the_session_ends_or_names_nobody():
    rank = {"kind": "rank", "who": "job-rank-3", "ranks": [3], "rank": 3, "pod": "job-rank-3", "cause": "network",
            "savingPct": 45.0}
    metrics.observe("u-end", "ns", "end", {"phase": "Running", "straggler": rank})
    labels, value = straggler_series()[("ns", "end")]
    assert (labels["pod"], labels["ranks"], value) == ("job-rank-3", "3", 0.45)
    metrics.observe("u-end", "ns", "end", {"straggler": None})             # the live verdict names nobody now
    assert ("ns", "end") not in straggler_series()
    metrics.observe("u-end", "ns", "end", {"straggler": rank})
    assert ("ns", "end") in straggler_series()
    metrics.observe("u-end", "ns", "end", {"phase": "Completed", "straggler": rank, "verdict": {"kind": "straggler"}})
    assert ("ns", "end") not in straggler_series()                          # so StragglerDetected resolves
    assert scrape()[("ns", "end", "straggler")] == 1                        # the final verdict stays
    metrics.forget("u-end")
