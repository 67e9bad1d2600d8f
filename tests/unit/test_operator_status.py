"""Status rendering and bounding, conditions, printer columns and label selectors."""

from __future__ import annotations

import datetime as dt
import json

from ingero.analysis import RankRow, Report, Straggler
from ingero_operator.settings import GatherSettings
from ingero_operator.status import bounded_warnings, condition, cut, node_row, report_status
from ingero_operator.tables import custom_columns, human_age, jsonpath, selector_matches, table


def report(n=64, straggler=True) -> Report:
    ranks = [RankRow(rank=i, node=f"n{i // 8}", pod=f"w-{i}", pid=100 + i, collectives=400, p50_ms=1.0,
                     p99_ms=2.0, late_ms=0.1, late_z=float(i % 5), retransmits=i, retransmits_in_window=i // 2,
                     offcpu_ms={"runqueue": 12.3456, "io": 0.0}) for i in range(n)]
    s = Straggler(rank=42, node="n5", pod="w-42", cause="network", score=0.93, evidence="x" * 5000,
                  saving_ms_per_step=12.345, saving_pct=23.456) if straggler else None
    return Report(ranks=ranks, straggler=s, step_ms=52.5, collectives=25600, retransmits=777,
                  warnings=[f"w{i}" for i in range(30)])


def test_status_is_bounded_however_large_the_job():
    g = GatherSettings(ranks_table_rows=8, evidence_chars=400, max_warnings=10)
    st = report_status(report(1024), 1024, g)
    assert len(st["ranksTable"]) == 8 and len(st["straggler"]["evidence"]) == 400
    assert len(json.dumps(st)) < 8_000
    assert st["ranks"] == 1024 and st["worldSize"] == 1024 and st["retransmits"] == 777
    warnings = bounded_warnings(report().warnings, g)
    assert len(warnings) == 10 and "21 more warnings" in warnings[-1]


def test_ranks_table_keeps_the_worst_ranks_in_rank_order():
    st = report_status(report(16), 16, GatherSettings(ranks_table_rows=3))
    ranks = [r["rank"] for r in st["ranksTable"]]
    assert ranks == sorted(ranks) and all(r["lateZ"] == 4.0 for r in st["ranksTable"])
    assert st["ranksTable"][0]["offcpuMs"] == {"io": 0.0, "runqueue": 12.3}


def test_straggler_fields_and_slowdown_column_value():
    st = report_status(report(), 64, GatherSettings())
    assert st["straggler"] | {"evidence": None} == {
        "rank": 42, "pod": "w-42", "node": "n5", "score": 0.93, "cause": "network", "evidence": None,
        "savingPct": 23.5, "savingMsPerStep": 12.35, "group": None, "kind": "rank",
        "who": "w-42", "ranks": [], "propagated": []}
    assert st["slowdown"] == "23.5%"


def test_no_straggler_clears_the_fields_with_merge_patch_nulls():
    st = report_status(report(straggler=False), 64, GatherSettings())
    assert "straggler" in st and st["straggler"] is None and st["slowdown"] is None


def test_condition_keeps_its_transition_time_while_unchanged():
    c1 = condition("Ready", True, "Tracing", "m", 1)
    old = [dict(c1[0], lastTransitionTime="2020-01-01T00:00:00Z")]
    same = condition("Ready", True, "Completed", "done", 2, old)
    assert same[0]["lastTransitionTime"] == "2020-01-01T00:00:00Z" and same[0]["observedGeneration"] == 2
    flipped = condition("Ready", False, "Failed", "no", 2, old)
    assert flipped[0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"


def test_node_rows_and_cut():
    row = node_row("n1", True, "running", 2, {"events": 10, "lost": 1}, (5, 60))
    assert row == {"name": "n1", "agentReached": True, "state": "running", "pods": 2, "events": 10, "lostEvents": 1,
                   "clockOffsetNs": 5, "clockRttNs": 60}
    assert node_row("n2", False, None, 1, None, None)["state"] == "unreachable"
    assert cut("abcdef", 4) == "abc…" and cut("ab", 4) == "ab"


CRD_COLUMNS = [{"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
               {"name": "Straggler", "type": "string", "jsonPath": ".status.straggler.pod"},
               {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]


def test_printer_column_paths_evaluate_on_a_status_and_render_a_table():
    created = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=75)).strftime("%Y-%m-%dT%H:%M:%SZ")
    obj = {"metadata": {"name": "s1", "creationTimestamp": created},
           "status": {"phase": "Running", "straggler": {"pod": "w-3"}, "nodes": [{"name": "n1"}]}}
    assert jsonpath(obj, ".status.straggler.pod") == "w-3" and jsonpath(obj, "{.status.nodes[0].name}") == "n1"
    assert jsonpath(obj, ".status.missing.x") is None
    t = table([obj], CRD_COLUMNS)
    assert [c["name"] for c in t["columnDefinitions"]] == ["Name", "Phase", "Straggler", "Age"]
    assert t["rows"][0]["cells"][:3] == ["s1", "Running", "w-3"] and t["rows"][0]["cells"][3] in ("75s", "76s")
    assert custom_columns(CRD_COLUMNS) == ("custom-columns=NAME:.metadata.name,PHASE:.status.phase,"
                                           "STRAGGLER:.status.straggler.pod,AGE:.metadata.creationTimestamp")


def test_ages_read_like_kubectl():
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    ago = lambda s: (now - dt.timedelta(seconds=s)).isoformat()  # noqa: E731
    assert [human_age(ago(s), now) for s in (5, 130, 700, 4 * 3600, 3 * 86400)] == ["5s", "2m10s", "11m", "4h", "3d"]


def test_equality_label_selectors():
    pod = {"metadata": {"labels": {"job-name": "j", "tier": "a"}}}
    assert selector_matches(pod, "job-name=j,tier==a") and selector_matches(pod, "tier!=b,job-name")
    assert not selector_matches(pod, "job-name=k") and not selector_matches(pod, "!tier")
    assert selector_matches(pod, "")
