"""The "spread" rule on hand-built steps (ingero.analysis.verdict): what fixing imbalance
proper saves (`_persistent`), judged net of the runqueue wait inside the ranks' own work
(`_spread_estimate`, `runq_in_events`), and what the verdict then says (`_named`); on the
same steps, what a rank's fix sets its work to and the starved rank the verdict names.

Each job: four ranks of one role, one sync event per rank and step (a collective of all
four, the step's marker), own work before it; the step is the slowest rank's work plus the
transfer."""

from __future__ import annotations

import numpy as np

from ingero.analysis.calls import Events
from ingero.analysis.model import RankRow
from ingero.analysis.replay import measure
from ingero.analysis.steps import Timeline
from ingero.analysis.stats import Retransmits, RunqTails
from ingero.analysis.verdict import (SAVING_FLOOR_PCT, Candidate, _job, _named, _persistent, _spread_estimate,
                                     decide, runq_in_events)

MS = 1_000_000
X = 2 * MS                    # every collective's transfer


def _steps(work_ms: np.ndarray) -> Timeline:
    """`work_ms[k, r]`: rank r's own work before its step-k collective (k = 0 is the anchor
    before the window: steps = rows - 1)."""
    steps1, R = work_ms.shape
    w = (np.asarray(work_ms, np.float64) * MS).astype(np.int64)
    a = np.zeros((steps1, R), np.int64)
    end = np.zeros(steps1, np.int64)
    prev = 0
    for k in range(steps1):
        a[k] = prev + w[k]
        end[k] = prev = int(a[k].max()) + X
    n = steps1 * R
    rank = np.repeat(np.arange(R), steps1)                     # events by (rank, arrival)
    step = np.tile(np.arange(steps1), R)
    ev = Events(ranks=np.arange(R), off=np.arange(R + 1) * steps1, rank=rank, a=a.T.ravel(), e=end[step],
                inst=step.copy(), dep_ptr=np.zeros(n + 1, np.int64), dep_idx=np.zeros(0, np.int64),
                p2p_pairs=0, unpaired=0)
    key = np.where(step >= 1, step - 1, -1)                    # (role 0, step, ordinal 0), one slot
    return Timeline(ev=ev, m=measure(ev), role=np.zeros(n, np.int64), key=key, inwin=step >= 1,
                    marker_inst=np.arange(steps1)[None, :], steps=steps1 - 1, stage_of={},
                    since=np.zeros(n, np.int64), slots=1)


def _slot(tl: Timeline) -> np.ndarray:
    return np.where(tl.key >= 0, tl.role * tl.slots + tl.since, -1)


def _one_slow_each_step(steps: int = 8, slow: float = 20.0) -> np.ndarray:
    """10 ms of work each, one rank (another each step) `slow` ms."""
    work = np.full((steps + 1, 4), 10.0)
    for k in range(1, steps + 1):
        work[k, k % 4] = slow
    return work


def test_a_rank_slower_than_its_step_is_imbalance_proper():
    tl = _steps(_one_slow_each_step())
    est = _persistent(tl, _slot(tl), tl.m.w)
    assert est.step == 22 * MS                                   # the slow rank's 20 ms + the transfer
    assert est.persistent == 10 * MS                             # each step's slow rank at the others' 10 ms
    assert est.jitter == 0.0                                     # nothing else varies


def test_a_step_the_whole_job_was_slow_in_is_no_imbalance():
    work = np.full((9, 4), 10.0)
    work[3:6] = 20.0                                             # the machine: every rank slow in steps 3-5
    tl = _steps(work)
    est = _persistent(tl, _slot(tl), tl.m.w)
    assert est.persistent == 0.0
    assert est.step == (5 * 12 + 3 * 22) * MS / 8
    assert est.jitter == 3 * 10 * MS / 8                        # what capping every event at 10 ms removes


def test_jitter_of_single_events_is_what_capping_each_would_remove_over_sqrt_n():
    # every rank 14 ms in step 1 only: the job's level that step, which no rank's ratio to it
    # explains and capping each event at its slot's median takes out (one event per rank and
    # step: n = 1, nothing averages out)
    work = np.full((9, 4), 10.0)
    work[1] = 14.0
    tl = _steps(work)
    est = _persistent(tl, _slot(tl), tl.m.w)
    assert est.persistent == 0.0
    assert est.jitter == 4 * MS / 8                              # step 1 capped at 10 ms, per step


def _tails(rank, start_ms, end_ms) -> RunqTails:
    return RunqTails(np.array(rank, np.int64), (np.array(start_ms, np.float64) * MS).astype(np.int64),
                     (np.array(end_ms, np.float64) * MS).astype(np.int64))


def _slow_windows(tl: Timeline) -> tuple[list, list, list]:
    """Each step's slow rank's extra 10 ms: the end of its own work window."""
    ev, m = tl.ev, tl.m
    sel = np.flatnonzero(tl.inwin & (m.w == 20 * MS))
    return ev.rank[sel].tolist(), ((ev.a[sel] - 10 * MS) / MS).tolist(), (ev.a[sel] / MS).tolist()


def test_overlapping_waits_of_a_ranks_threads_count_once_where_asked():
    tl = _steps(_one_slow_each_step(steps=4))
    rk, s, e = _slow_windows(tl)
    # two threads wait in each slow window: its last 10 ms, and 10 ms from 9 ms before its
    # end (1 ms in the call after it)
    tails = _tails(rk + rk, s + [x + 1 for x in s], e + [x + 1 for x in e])
    each = runq_in_events(tl, tails)
    once = runq_in_events(tl, tails, once=True)
    slow = tl.m.w == 20 * MS
    assert (each[slow] == 19 * MS).all() and (once[slow] == 10 * MS).all()
    assert not each[~slow].any() and not once[~slow].any()       # other ranks, the anchor step


def _spread_job(tl: Timeline, tails: RunqTails | None):
    return _job(tl, {}, 10_000 * MS, tails, tl.step_ns(tl.ev.e))


def _spread(saving_ms: float) -> Candidate:
    return Candidate("spread", [0, 1, 2, 3], saving_ms * MS, "spread: no single rank", cause="imbalance")


def test_spread_is_judged_on_the_work_less_the_waits_for_a_cpu():
    tl = _steps(_one_slow_each_step())
    best = Candidate("rank", [1], 1 * MS, "rank 1")
    est = _spread_estimate(_spread_job(tl, None), _spread(10.0), best)
    assert est is not None and est.persistent == 10 * MS and est.net == ""
    no_waits = _tails([], [], [])
    assert _spread_estimate(_spread_job(tl, no_waits), _spread(10.0), best).net == ""
    rk, s, e = _slow_windows(tl)
    waited = _spread_job(tl, _tails(rk, s, e))                   # the slow ranks' extra 10 ms: a wait for a CPU
    assert _spread_estimate(waited, _spread(10.0), best) is None
    half = _spread_job(tl, _tails(rk, [x + 5 for x in s], e))    # 5 of the 10 ms: 5 of 17 ms of the step left
    assert half.work_step == 17 * MS
    est = _spread_estimate(half, _spread(10.0), best)
    assert est is not None and est.step == 17 * MS and est.persistent == 5 * MS
    assert est.net == ", less their waits for a CPU"
    # "fix everyone" is judged against that step too: 2.1 ms is 12% of 17 ms, 9.5% of 22
    assert _spread_estimate(half, _spread(2.1), Candidate("rank", [1], 0.1 * MS, "rank 1")) is not None
    assert _spread_estimate(_spread_job(tl, None), _spread(2.1), best) is None


def test_spread_needs_imbalance_proper_over_the_floor_of_the_step_it_replays():
    # one slow rank a step, `slow` ms against 10 ms: (slow - 10) / (slow + 2) of the step
    best = Candidate("rank", [1], 0.1 * MS, "rank 1")
    for slow, named in ((10.6, False), (10.7, True)):            # 4.8% and 5.5%
        tl = _steps(_one_slow_each_step(slow=slow))
        est = _spread_estimate(_spread_job(tl, None), _spread(10.0), best)
        assert (est is not None) == named, (slow, est)
        if est is not None:
            assert 100 * est.persistent / est.step >= SAVING_FLOOR_PCT


def test_spread_named_says_its_figures_and_the_worst_rank():
    tl = _steps(_one_slow_each_step())
    j = _spread_job(tl, None)
    best = Candidate("rank", [1], 1.5 * MS, "rank 1")
    spread = _named(j, best, _spread(4.0))
    assert spread is not None and spread.kind == "spread" and spread.score == 0.38
    assert spread.worst == max(j.excess, key=j.excess.get)        # the rank with the most excess own work
    assert spread.why == ("fixing every rank's excess own work would save 4.0 ms/step (10.0 from ranks working "
                          "longer for a whole step, jitter would give 0.0); the best single fix (rank 1) only "
                          "38% of that")
    half = Candidate("rank", [1], 2 * MS, "rank 1")
    assert _named(j, half, _spread(4.0)) is half                 # half of it: no spread, the rank (9%)


def test_a_ranks_fix_sets_its_work_to_its_peers_median_and_never_lengthens_it():
    work = np.tile([5.0, 10.0, 11.0, 20.0], (5, 1))               # per step: ranks 0-3
    j = _spread_job(_steps(work), None)
    fixed = j.fixed_w[j.tl.inwin].reshape(4, 4) / MS             # by rank, then step
    assert fixed[0].tolist() == [5.0] * 4                        # under the others' median (11): kept
    assert fixed[1].tolist() == [10.0] * 4                       # under theirs (11) too
    assert fixed[2].tolist() == fixed[3].tolist() == [10.0] * 4  # over theirs: set to it


def _starved_rows(waits: int) -> dict:
    """Rank 2 waited 2 s in the runqueue over the session in `waits` waits, its peers 100 ms in 100."""
    return {r: RankRow(rank=r, node=None, pod=None, pid=r, offcpu_ms={"runqueue": 2000.0 if r == 2 else 100.0},
                       offcpu_waits={"runqueue": waits if r == 2 else 100}) for r in range(4)}


def test_a_rank_starved_of_cpu_inside_its_collectives_is_named_though_its_own_work_is_its_peers():
    tl = _steps(np.full((9, 4), 10.0))
    none = Retransmits(np.zeros(0, np.int64), np.zeros(0, np.int64), [], np.zeros(0, bool))
    d = decide(tl, _starved_rows(10), none, 10_000 * MS)          # 200 ms a wait vs its peers' 1 ms
    assert d.named is not None and (d.named.kind, d.named.ranks, d.named.cause) == ("rank", [2], "cpu-contention")
    assert round(d.named.saving_ns / MS, 3) == 0.9 * X / MS       # 90% of every transfer it is in, at most
    assert decide(tl, _starved_rows(1000), none, 10_000 * MS).named is None     # 2 ms a wait: only more of them


def test_a_rank_with_an_off_cpu_cause_of_its_own_is_named_over_spread_from_5_percent_of_the_step():
    j = _spread_job(_steps(_one_slow_each_step()), None)          # a 22 ms step, spread saves 10 ms
    rank = Candidate("rank", [1], 1_100_000, "rank 1", cause="cpu-contention")     # 5% of it exactly
    assert _named(j, rank, _spread(10.0)) is rank
    assert rank.notes == ["the rest is spread over the ranks: fixing every rank's excess own work would save "
                          "10.0 ms/step, this rank 11% of that"]
    less = Candidate("rank", [1], 1_099_999, "rank 1", cause="cpu-contention")
    assert _named(j, less, _spread(10.0)).kind == "spread"
    assert _named(j, Candidate("rank", [1], 2 * MS, "rank 1"), _spread(10.0)).kind == "spread"   # no cause


def test_spread_named_with_no_single_fix_says_none_and_the_jitter():
    work = _one_slow_each_step()
    work[1] += 1.0                                                # every rank 1 ms longer in step 1
    spread = _named(_spread_job(_steps(work), None), None, _spread(4.0))
    assert spread is not None and spread.score == 0.0
    assert spread.why == ("fixing every rank's excess own work would save 4.0 ms/step (10.0 from ranks working "
                          "longer for a whole step, jitter would give 0.1); the best single fix (none) only 0% "
                          "of that")


def test_the_jitter_counts_against_imbalance_proper():
    best = Candidate("rank", [1], 0.1 * MS, "rank 1")
    work = _one_slow_each_step(slow=10.7)                         # 0.7 ms of a 12.7 ms step: 5.5%
    assert _spread_estimate(_spread_job(_steps(work), None), _spread(10.0), best) is not None
    work[1] += 1.0                                                # less its jitter: under 5%
    assert _spread_estimate(_spread_job(_steps(work), None), _spread(10.0), best) is None


def test_the_verdict_names_the_rank_whose_fix_saves_most():
    # ranks 1 and 2 work 20 and 14 ms a step against 10: fixing rank 1 saves 6 ms, rank 2 nothing
    tl = _steps(np.tile([10.0, 20.0, 14.0, 10.0], (9, 1)))
    none = Retransmits(np.zeros(0, np.int64), np.zeros(0, np.int64), [], np.zeros(0, bool))
    d = decide(tl, {}, none, 10_000 * MS)
    assert d.named is not None and d.named.ranks == [1] and round(d.named.saving_ns / MS, 3) == 6.0
