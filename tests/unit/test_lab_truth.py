"""A clean lab job's verdict against the kernel's own runqueue counts (ingero.lab.truth)."""

from __future__ import annotations

from ingero.analysis.model import Straggler
from ingero.lab.truth import clean_verdict_problem, machine_starved


def _stats(*runq_ms, steps=20):
    return {r: {"steps": steps, "runq_ms": w} for r, w in enumerate(runq_ms)}


def _named(rank=1, cause="cpu-contention", saving=8.4, kind="rank"):
    return Straggler(rank=rank, node="lab-node-a", pod=f"p{rank}", cause=cause, score=1.0, evidence="e",
                     saving_ms_per_step=saving, saving_pct=9.7, kind=kind)


def test_nobody_is_right_for_a_clean_job():
    assert clean_verdict_problem(None, _stats(300, 300, 300, 300)) == ""


def test_a_rank_the_machine_starved_may_be_named_cpu_contention():
    # the CI of 058ec6f: 851 ms against 354-522 (here over the steps), 8.4 ms/step saved over
    # 20 steps needs 84 ms more than the peers' median
    assert clean_verdict_problem(_named(), _stats(354, 851, 438, 522)) == ""
    assert machine_starved(_stats(354, 851, 438, 522), 1, 8.4) == ""


def test_a_rank_named_that_the_machine_did_not_starve_is_wrong():
    why = clean_verdict_problem(_named(), _stats(354, 480, 438, 522))
    assert "less than 84 ms more" in why, why
    why = clean_verdict_problem(_named(), _stats(354, 500, 438, 470))
    assert "less than 84 ms more" in why, why


def test_the_named_rank_need_not_wait_longest_when_it_waits_enough_more():
    # a peer that waits for a CPU inside its collectives slows nobody
    assert clean_verdict_problem(_named(), _stats(354, 851, 438, 900)) == ""


def test_any_other_cause_or_a_group_is_wrong_for_a_clean_job():
    assert "compute/unknown" in clean_verdict_problem(_named(cause="compute/unknown"), _stats(354, 851, 438, 522))
    assert "network" in clean_verdict_problem(_named(cause="network"), _stats(354, 851, 438, 522))
    assert clean_verdict_problem(_named(kind="spread", cause="imbalance"), _stats(354, 851, 438, 522))


def test_without_the_kernel_counts_a_named_rank_is_wrong():
    stats = _stats(354, 851, 438, 522)
    del stats[2]["runq_ms"]
    assert "no runqueue wait" in clean_verdict_problem(_named(), stats)


def test_a_status_straggler_is_judged_alike():
    st = {"rank": 1, "kind": "rank", "cause": "cpu-contention", "group": None, "savingMsPerStep": 8.4}
    assert clean_verdict_problem(st, _stats(354, 851, 438, 522)) == ""
    assert clean_verdict_problem(dict(st, cause="compute/unknown"), _stats(354, 851, 438, 522))


def test_hang_truth_wants_the_victim_named_only_when_it_stopped_for_good():
    from ingero.analysis.model import Hang
    from ingero.lab.truth import hang_problem

    lab = {"scenario": "hang", "victim_rank": 2, "config": {"hang_s": None}}
    named = Hang(waiting=[{"rank": 0}, {"rank": 1}, {"rank": 3}], missing=[2], op="ALL_REDUCE", comm="ab",
                 seq=5, waited_s=20.0, evidence="")
    assert hang_problem(named, lab) == ""
    assert hang_problem({"missing": [2], "waiting": [{"rank": 0}]}, lab) == ""
    assert "no hang was found" in hang_problem(None, lab)
    assert "names [1] as missing" in hang_problem(Hang([{"rank": 0}], [1], None, None, None, 1.0, ""), lab)
    assert "waiting ranks are wrong" in hang_problem(Hang([{"rank": 2}], [2], None, None, None, 1.0, ""), lab)
    continued = {"scenario": "hang", "victim_rank": 2, "config": {"hang_s": 15.0}}
    assert hang_problem(None, continued) == ""
    assert "did not hang was judged a hang" in hang_problem(named, continued)
    assert hang_problem(None, {"scenario": "clean", "victim_rank": 3, "config": {}}) == ""
