"""The analysis's fast paths against their plain definitions: call order, duplicate calls, and
the replay's schedule (found once, reused) against a round-by-round replay."""

from __future__ import annotations

import numpy as np
import pytest

from ingero.analysis.calls import Events, _call_order, _dups, _stream_order
from ingero.analysis.replay import replay


def test_call_order_is_rank_time_event_id_without_unranked_rows():
    rng = np.random.default_rng(1)
    n = 5000
    rank = rng.integers(-1, 8, n)
    t = rng.integers(0, 50, n) * 1_000 + 1_700_000_000_000_000_000   # many ties in time
    eid = rng.permutation(n).astype(np.uint64)
    want = np.lexsort((eid, t, rank))
    want = want[rank[want] >= 0]
    assert np.array_equal(_call_order(rank, t, eid), want)
    wide = t.copy()
    wide[0] = 0                                          # rank and time no longer fit one int64
    want = np.lexsort((eid, wide, rank))
    assert np.array_equal(_call_order(rank, wide, eid), want[rank[want] >= 0])


@pytest.mark.parametrize("instances", [50, 100_000])    # keys counted, or sorted (wide span)
def test_duplicate_calls_are_the_repeats_after_the_first(instances):
    rng = np.random.default_rng(2)
    n = 400
    inst = rng.integers(-1, instances, n)
    rank = rng.integers(0, 4, n)
    inst[[10, 20, 30]], rank[[10, 20, 30]] = 7, 2        # a rank calling one instance three times
    seen, want = set(), np.zeros(n, bool)
    for i, (k, r) in enumerate(zip(inst.tolist(), rank.tolist())):
        if k >= 0:
            want[i] = (k, r) in seen
            seen.add((k, r))
    assert want.any()
    assert np.array_equal(_dups(inst, rank), want)
    first = np.unique(inst * 4 + rank, return_index=True)[1]
    inst2 = np.full(n, -1)
    inst2[first] = inst[first]                           # no repeats left
    assert not _dups(inst2, rank).any()


def _rounds(ev: Events, w, x):
    """The replay's definition, one round at a time: an event arrives once the events it
    follows (its rank's previous one, or those of ``ev.prev_ptr``) have completed, at the
    latest of their ends + own work; an event ends once every dependency and instance member
    has arrived (or, when none can, every waiting one is released) at the latest arrival + x."""
    n, neg = len(ev.a), np.iinfo(np.int64).min
    A, E = np.zeros(n, np.int64), np.zeros(n, np.int64)
    if ev.prev_ptr is None:
        prev = [[] if i in set(ev.off.tolist()) else [i - 1] for i in range(n)]
    else:
        prev = [ev.prev_idx[ev.prev_ptr[i]:ev.prev_ptr[i + 1]].tolist() for i in range(n)]
    arrived, completed = np.zeros(n, bool), np.zeros(n, bool)
    deps = [ev.dep_idx[ev.dep_ptr[i]:ev.dep_ptr[i + 1]].tolist() for i in range(n)]
    members: dict = {}
    for i, k in enumerate(ev.inst.tolist()):
        if k >= 0:
            members.setdefault(k, []).append(i)
    stuck = 0
    while not completed.all():
        for i in range(n):
            if not arrived[i] and all(completed[p] for p in prev[i]):
                A[i] = max([E[p] for p in prev[i]], default=ev.a[i]) + w[i]
                arrived[i] = True
        cur = [i for i in range(n) if arrived[i] and not completed[i]]
        ok = {i: all(arrived[d] for d in deps[i]) and (ev.inst[i] < 0 or all(arrived[m] for m in members[ev.inst[i]]))
              for i in cur}
        if not any(ok.values()):
            stuck += 1
            ok = dict.fromkeys(ok, True)
        done = []
        for i in cur:
            if ok[i]:
                got = [A[i]] + [A[d] for d in deps[i] if arrived[d]]
                if ev.inst[i] >= 0:
                    got += [A[m] for m in members[ev.inst[i]] if arrived[m]]
                E[i] = max(max(got), neg) + x[i]
                done.append(i)
        completed[done] = True
    return A, E, stuck


@pytest.mark.parametrize("seed", range(6))
def test_the_scheduled_replay_is_the_round_by_round_replay(seed):
    rng = np.random.default_rng(seed)
    nr, per = 5, 12
    n = nr * per
    rank = np.repeat(np.arange(nr), per)
    a = np.sort(rng.integers(0, 10_000, n).reshape(nr, per), axis=1).ravel()
    inst = np.full(n, -1)
    for k in range(per // 2):                          # collectives, some of every rank, some of a few
        who = np.arange(nr) if k % 2 == 0 else rng.choice(nr, 3, replace=False)
        inst[who * per + 2 * k] = k
    src, dst = [], []
    for _ in range(8):                                 # p2p dependencies, cycles included
        i, j = rng.integers(0, n, 2)
        if rank[i] != rank[j] and inst[i] < 0:
            src.append(i), dst.append(j)
    o = np.argsort(src, kind="stable")
    src, dst = np.array(src, np.int64)[o], np.array(dst, np.int64)[o]
    dep_ptr = np.r_[0, np.cumsum(np.bincount(src, minlength=n))]
    ev = Events(ranks=np.arange(nr), off=np.arange(0, n + 1, per), rank=rank, a=a, e=a + 50, inst=inst,
                dep_ptr=dep_ptr, dep_idx=dst, p2p_pairs=len(src), unpaired=0)
    for lanes in (False, True):
        if lanes:        # two streams per rank: the events it follows, as _stream_order finds them
            ev.prev_ptr, ev.prev_idx = _stream_order(rank, a, a + rng.integers(0, 3_000, n), rng.integers(0, 3, n))
            ev.schedule = None
            assert (np.diff(ev.prev_ptr) > 1).sum() > nr and (np.diff(ev.prev_ptr) == 0).sum() > nr
        for trial in range(3):
            w = rng.integers(0, 300, n)
            w[ev.off[:-1]] = 0
            x = rng.integers(0, 100, n)
            A, E, stuck = _rounds(ev, w, x)
            r = replay(ev, w, x)                       # the schedule is found once, then reused
            assert (r.stuck_rounds, r.a.tolist(), r.e.tolist()) == (stuck, A.tolist(), E.tolist())
