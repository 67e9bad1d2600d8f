"""Replaying a session's sync events with changed own work or transfer times.

Per sync event: own work ``w`` (from the rank's previous return to this
arrival), transfer ``x`` (from the moment every dependency had arrived to the
return). A replay recomputes arrival = previous end + w, ready = the latest
arrival among itself and its dependencies, end = ready + x, in rounds: each
round takes every rank's next event whose dependencies have arrived. Replaying
the measured w and x gives back the measured timeline; replaying with a
rank's w set to its peers' gives what the job would do without that rank's
excess: the what-if.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.analysis.calls import Events

_NEG = np.iinfo(np.int64).min


@dataclass
class Measured:
    w: np.ndarray         # own work before each event, ns
    x: np.ndarray         # transfer after its dependencies arrived, ns
    ready: np.ndarray     # when its last dependency (or itself) arrived
    crit: np.ndarray      # the rank that arrived last among its dependencies (itself if none later)


def measure(ev: Events) -> Measured:
    n = len(ev.a)
    w = np.zeros(n, np.int64)
    if n:
        prev_end = np.r_[0, ev.e[:-1]]
        w = ev.a - prev_end
        w[ev.off[:-1]] = 0                       # a rank's first event: anchored at its arrival
        w = np.maximum(w, 0)
    ready = ev.a.copy()
    crit = ev.rank.copy()
    # collectives: the latest member arrival of the instance
    has = ev.inst >= 0
    if has.any():
        ni = int(ev.inst.max()) + 1
        mx = np.full(ni, _NEG, np.int64)
        np.maximum.at(mx, ev.inst[has], ev.a[has])
        idx = np.flatnonzero(has)
        ready[idx] = np.maximum(ready[idx], mx[ev.inst[idx]])
        # who arrived last per instance
        o = np.lexsort((ev.a[idx], ev.inst[idx]))
        last = np.r_[ev.inst[idx][o][1:] != ev.inst[idx][o][:-1], True]
        who = np.full(ni, -1, np.int64)
        who[ev.inst[idx][o][last]] = ev.rank[idx][o][last]
        late = ready[idx] > ev.a[idx]
        crit[idx[late]] = who[ev.inst[idx[late]]]
    # p2p: the latest dependency
    nd = np.diff(ev.dep_ptr)
    if len(ev.dep_idx):
        src = np.repeat(np.arange(n), nd)
        da = ev.a[ev.dep_idx]
        o = np.lexsort((da, src))
        lastd = np.r_[src[o][1:] != src[o][:-1], True]
        s_last, d_last = src[o][lastd], ev.dep_idx[o][lastd]
        later = ev.a[d_last] > ready[s_last]
        ready[s_last[later]] = ev.a[d_last[later]]
        crit[s_last[later]] = ev.rank[d_last[later]]
    x = np.maximum(ev.e - ready, 0)
    return Measured(w=w, x=x, ready=ready, crit=crit)


@dataclass
class Replayed:
    a: np.ndarray
    e: np.ndarray
    stuck_rounds: int


def replay(ev: Events, w: np.ndarray, x: np.ndarray) -> Replayed:
    """Arrivals and ends of every event with own work `w` and transfers `x`."""
    n = len(ev.a)
    A = np.zeros(n, np.int64)
    E = np.zeros(n, np.int64)
    if n == 0:
        return Replayed(A, E, 0)
    nr = len(ev.ranks)
    lo, hi = ev.off[:-1].copy(), ev.off[1:]
    ptr = lo.copy()
    prev_end = ev.a[lo].astype(np.int64)          # first events anchor at the measured arrival
    arrived = np.zeros(n, bool)
    ni = int(ev.inst.max()) + 1 if (ev.inst >= 0).any() else 0
    inst_cnt = np.zeros(ni, np.int64)
    inst_size = np.bincount(ev.inst[ev.inst >= 0], minlength=ni)
    inst_max = np.full(ni, _NEG, np.int64)
    ndeps = np.diff(ev.dep_ptr)
    # reverse CSR: for each event, the events that depend on it
    if len(ev.dep_idx):
        src = np.repeat(np.arange(n), ndeps)
        o = np.argsort(ev.dep_idx, kind="stable")
        rev_src = src[o]
        rev_ptr = np.zeros(n + 1, np.int64)
        np.add.at(rev_ptr, ev.dep_idx + 1, 1)
        rev_ptr = np.cumsum(rev_ptr)
        has_rev = np.diff(rev_ptr) > 0
    else:
        rev_src = np.zeros(0, np.int64)
        rev_ptr = np.zeros(n + 1, np.int64)
        has_rev = np.zeros(n, bool)
    dep_cnt = np.zeros(n, np.int64)
    dep_max = np.full(n, _NEG, np.int64)
    stuck = 0
    active = np.arange(nr)
    while len(active):
        cur = ptr[active]
        new = ~arrived[cur]
        if new.any():
            cn = cur[new]
            A[cn] = prev_end[active[new]] + w[cn]
            arrived[cn] = True
            ci = ev.inst[cn]
            m = ci >= 0
            if m.any():
                np.add.at(inst_cnt, ci[m], 1)
                np.maximum.at(inst_max, ci[m], A[cn[m]])
            r = cn[has_rev[cn]]
            if len(r):
                cnt = rev_ptr[r + 1] - rev_ptr[r]
                at = np.repeat(rev_ptr[r], cnt) + (np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt))
                dep = rev_src[at]
                np.add.at(dep_cnt, dep, 1)
                np.maximum.at(dep_max, dep, np.repeat(A[r], cnt))
        ci = ev.inst[cur]
        ok = dep_cnt[cur] == ndeps[cur]
        m = ci >= 0
        ok[m] &= inst_cnt[ci[m]] == inst_size[ci[m]]
        if not ok.any():                        # a cycle in bad data: release everyone waiting
            stuck += 1
            ok[:] = True
        go, rk = cur[ok], active[ok]
        ready = np.maximum(A[go], dep_max[go])
        gi = ev.inst[go]
        mi = gi >= 0
        ready[mi] = np.maximum(ready[mi], inst_max[gi[mi]])
        E[go] = ready + x[go]
        prev_end[rk] = E[go]
        ptr[rk] += 1
        active = active[ptr[active] < hi[active]]
    return Replayed(A, E, stuck)
