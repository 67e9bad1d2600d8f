"""The runqueue wait inside a rank's own work (ingero.analysis.verdict.runq_in_own_work):
runnable tails of off-CPU intervals clipped to [arrival - own work, arrival] of the rank's
sync events in the step window, per step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ingero.analysis.verdict import OwnRunq, _own_runq, runq_in_own_work

MS = 1_000_000


def _tl(rank, a, w, inwin=None, steps=2):
    rank = np.array(rank, np.int64)
    ev = SimpleNamespace(ranks=np.unique(rank), rank=rank, a=np.array(a, np.int64) * MS)
    m = SimpleNamespace(w=np.array(w, np.int64) * MS)
    inwin = np.ones(len(rank), bool) if inwin is None else np.array(inwin, bool)
    return SimpleNamespace(ev=ev, m=m, inwin=inwin, steps=steps)


def _tails(rank, start, end):
    return (np.array(rank, np.int64), np.array(start, np.int64) * MS, np.array(end, np.int64) * MS)


def test_only_the_wait_inside_own_work_counts_and_is_per_step():
    # rank 0 works [0, 10] and [20, 30] (arrivals at 10 and 30; in calls 10-20 and 30-40),
    # rank 1 works [0, 5] and [20, 25]
    tl = _tl([0, 0, 1, 1], [10, 30, 5, 25], [10, 10, 5, 5])
    tails = _tails([0, 0, 0, 1, 1],
                   [2, 12, 28, 12, 3],      # rank 0: 2-6 inside, 12-18 in a call, 28-35 half in
                   [6, 18, 35, 18, 4])      # rank 1: 12-18 in a call, 3-4 inside
    out = runq_in_own_work(tl, tails)
    assert out == {0: (4 + 2) * MS / 2, 1: 1 * MS / 2}


def test_events_outside_the_step_window_and_tails_of_other_processes_do_not_count():
    tl = _tl([0, 0, 1], [10, 30, 10], [10, 10, 10], inwin=[False, True, True], steps=1)
    tails = _tails([0, 0, -1, 1], [2, 25, 25, 0], [6, 27, 27, 10])
    assert runq_in_own_work(tl, tails) == {0: 2 * MS, 1: 10 * MS}


def test_a_tail_spanning_two_windows_counts_both_parts_only():
    tl = _tl([0, 0, 1, 1], [10, 30, 10, 30], [10, 10, 10, 10])
    # 5-25: 5 ms in [0, 10], 5 ms in [20, 30]; the call 10-20 between them does not count
    out = runq_in_own_work(tl, _tails([0], [5], [25]))
    assert out == {0: 10 * MS / 2, 1: 0.0}


def test_the_share_is_the_wait_beyond_the_peers_rate_per_excess_own_work():
    """Peers wait 10+12+14 ms per step in 40+40+40 of own work: 36 ms per 84 of the rest of
    it. Rank 0 works 49 ms, 30 of them waiting: its 19 of other work would wait ~8.1."""
    rq = {0: 30 * MS, 1: 10 * MS, 2: 12 * MS, 3: 14 * MS}
    own = {0: 49 * MS, 1: 40 * MS, 2: 40 * MS, 3: 40 * MS}
    got = _own_runq(rq, own, 0, 9 * MS, 20)
    expected = 36 / 84 * 19 * MS
    assert got == OwnRunq(mine=30 * MS, peers=pytest.approx(expected), share=pytest.approx((30 * MS - expected) / (9 * MS)),
                          steps=20)
    assert _own_runq(rq, own, 0, 0.0, 20) is None
    assert _own_runq(None, own, 0, 9 * MS, 20) is None
    assert _own_runq({0: 1.0}, own, 0, 9 * MS, 20) is None


def test_a_rank_that_only_works_longer_on_a_busy_machine_waits_no_more_than_its_peers_rate():
    """Load 30 (a CI run beside cpu-hog labs): every rank waits for a CPU most of its own work,
    a slow rank in proportion to its longer work. Its excess wait is no starvation of its own
    (the peers' median would call 38 of its 53 ms of excess so); a starved rank, whose other
    work is as short as its peers', still waits far beyond their rate."""
    rq = {0: 51.2 * MS, 1: 103.8 * MS, 2: 65.7 * MS, 3: 80.1 * MS}
    own = {0: 64.6 * MS, 1: 119.7 * MS, 2: 66.6 * MS, 3: 78.6 * MS}
    slow = _own_runq(rq, own, 1, 53.1 * MS, 40)
    assert slow is not None and slow.share == 0.0
    starved = _own_runq({**rq, 1: 150 * MS}, {**own, 1: 152 * MS}, 1, 85.4 * MS, 40)
    assert starved is not None and starved.share > 0.5
