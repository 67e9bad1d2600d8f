"""Checks on a finished TraceSession's status, shared by every whole-flow test: the embedded
API server (tests/cluster/test_whole_flow.py) and a kind cluster (tests/e2e/test_kind.py)
read the same status and must pass the same checks."""

from __future__ import annotations

import json


def check_completed(status: dict, ranks: int, nodes: list[str] | None = None) -> dict:
    """The session completed with every rank traced and a Ready condition; returns the status."""
    assert status.get("phase") == "Completed", json.dumps(status)[:2000]
    assert status["ranks"] == ranks and status["worldSize"] == ranks, (status.get("ranks"), status.get("worldSize"))
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 1, ready
    if nodes is not None:
        assert sorted(n["name"] for n in status["nodes"]) == sorted(nodes), status["nodes"]
    assert all(n["agentReached"] and n["events"] > 0 for n in status["nodes"]), status["nodes"]
    assert status["artifact"]["path"] and status["artifact"]["report"], status.get("artifact")
    return status


def check_no_straggler(status: dict, ranks: int, nodes: list[str] | None = None,
                       stats: dict | None = None) -> dict:
    """A clean run: completed, no straggler named, no lost events, every rank in the table.

    `stats` ({rank: the lab worker's final stats}, lab runs only): a rank named cpu-contention
    is right too when the kernel's own counts show the busy machine starved it
    (ingero.lab.truth.clean_verdict_problem)."""
    st = check_completed(status, ranks, nodes)
    if stats is not None and st.get("straggler") is not None:
        from ingero.lab.truth import clean_verdict_problem
        problem = clean_verdict_problem(st["straggler"], stats)
        assert not problem and st.get("slowdown"), (problem, json.dumps(st.get("straggler")))
    else:
        assert st.get("straggler") is None and st.get("slowdown") is None, json.dumps(st.get("straggler"))
        # judged, nobody named: not a trace that could not support a verdict
        assert st["verdict"]["kind"] == "none" and st["verdict"]["who"] == "none", st["verdict"]
    assert all(n["lostEvents"] == 0 for n in st["nodes"]), st["nodes"]
    assert len(st["ranksTable"]) == min(ranks, 8) and all(r["collectives"] > 0 for r in st["ranksTable"])
    return st


def check_straggler(status: dict, ranks: int, rank: int, node: str, cause: str) -> dict:
    """A run with a fault: completed, and the faulty rank named, on its node, with the cause,
    a positive saving and some evidence. Returns the straggler."""
    st = check_completed(status, ranks)
    s = st.get("straggler")
    assert s is not None, (f"nobody named; best single fix {st.get('bestSavingPct')}% of the step "
                           f"({st.get('meanStepMs')} ms); ranks {json.dumps(st.get('ranksTable'))}")
    assert (s["rank"], s["node"], s["cause"]) == (rank, node, cause), json.dumps(st, indent=1)[:3000]
    assert s["savingPct"] > 0 and s["evidence"], s
    assert st["slowdown"].endswith("%")
    return s
