"""Replaying a session's sync events with changed own work or transfer times.

Per sync event: own work ``w`` (from the rank's previous return to this
arrival), transfer ``x`` (from the moment every dependency had arrived to the
return). A replay recomputes arrival = previous end + w, ready = the latest
arrival among itself and its dependencies, end = ready + x, in rounds: each
round takes every rank's next event whose dependencies have arrived. On a
device with several streams (``Events.prev_ptr``) an event may follow several
of its rank's events (one per stream): its own work runs from the latest of
their ends, and a rank's streams replay side by side. Replaying
the measured w and x gives back the measured timeline; replaying with a
rank's w set to its peers' gives what the job would do without that rank's
excess: the what-if.
"""

from __future__ import annotations

from collections.abc import Callable
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
        if ev.prev_ptr is None:                  # each its rank's previous one
            w = ev.a - np.r_[0, ev.e[:-1]]
            w[ev.off[:-1]] = 0                   # a rank's first event: anchored at its arrival
        else:
            w = ev.a - _latest(ev.e[ev.prev_idx], ev.prev_ptr, ev.a)   # none: anchored
        w = np.maximum(w, 0)
    ready = ev.a.copy()
    crit = ev.rank.copy()
    # collectives: the latest member arrival of the instance, and who arrived last (of equal
    # arrivals the latest in event order)
    idx, first, _ = ev.by_inst()
    if len(idx):
        a = ev.a[idx]
        mx = np.repeat(np.maximum.reduceat(a, first), np.diff(np.r_[first, len(idx)]))
        ready[idx] = mx                          # (never below its own arrival)
        last = np.maximum.reduceat(np.where(a == mx, idx, -1), first)
        late = ready[idx] > a
        crit[idx[late]] = ev.rank[np.repeat(last, np.diff(np.r_[first, len(idx)]))[late]]
    # p2p: the latest dependency (of equal arrivals the last listed)
    if len(ev.dep_idx):
        src = np.repeat(np.arange(n), np.diff(ev.dep_ptr))
        da = ev.a[ev.dep_idx]
        mx = np.full(n, _NEG, np.int64)
        np.maximum.at(mx, src, da)
        eq = np.flatnonzero(da == mx[src])
        lastd = np.full(n, -1, np.int64)
        np.maximum.at(lastd, src[eq], eq)
        s_last = np.flatnonzero(lastd >= 0)
        d_last = ev.dep_idx[lastd[s_last]]
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


@dataclass
class Schedule:
    """A replay's rounds, by position: each round, the events that arrive (each rank's next
    one) and those that complete (every dependency arrived). Structural: whether an event
    may complete depends only on which of its dependencies have arrived, never on times,
    so the schedule is found once per Events and every replay only computes times, round
    by round over contiguous slices.

    Round 0's arrivals are the events that follow none (every rank's first); round k + 1's
    those whose previous events (one, or on streams the ones of ``Events.prev_ptr``) have
    all completed, the last of them in round k; ``arr_prev_pos``: their completion
    positions, per arrival, ``arr_prev_rel`` where each arrival's begin (relative to its
    round's first). ``arr``/``go``: the event ids in arrival/completion order.

    A completing event is ready at the latest arrival among itself and its p2p dependencies
    and among its instance's members (one group per instance and round), counting those
    arrived by its round: all of them, unless the round released a cycle. Per round,
    ``cat_pos`` holds the arrival positions of its completing events' segments (each
    itself, then its p2p dependencies) followed by its groups' (their members), and
    ``cat_rel`` where each segment begins (relative to the round's first); ``pick``: per
    completing event, the segment of its round whose latest arrival joins its own (its
    group's, else its own). ``plan``: per round, its slices of these, as Python ints (q0,
    q1: completions; c0, c1: cat_pos; s0, s1: segments; a0, a1: next round's arrivals; p0,
    p1: their previous events; single: one previous event each)."""

    arr: np.ndarray
    go: np.ndarray
    arr_prev_pos: np.ndarray
    arr_prev_rel: np.ndarray
    cat_pos: np.ndarray
    cat_rel: np.ndarray
    pick: np.ndarray
    plan: list
    stuck_rounds: int


def _latest(v: np.ndarray, ptr: np.ndarray, empty: np.ndarray) -> np.ndarray:
    """Per CSR segment, the largest of `v`; `empty`'s value for an empty one."""
    out = empty.astype(np.int64)
    seg = np.flatnonzero(np.diff(ptr) > 0)
    if len(seg):
        out[seg] = np.maximum.reduceat(v, ptr[seg])
    return out


def _expand(ptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The item indices of the CSR segments ``ptr[r]:ptr[r + 1]`` of `rows`, in order."""
    cnt = ptr[rows + 1] - ptr[rows]
    return np.repeat(ptr[rows] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))


def _releases(ev: Events) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """The events that follow none (round 0's arrivals), and a function that, given the
    events completing in a round, returns those that arrive next: the events whose previous
    ones (each its rank's previous one, or on streams those of ``Events.prev_ptr``) have
    all completed."""
    n = len(ev.a)
    if ev.prev_ptr is None or ev.prev_idx is None:   # each event follows its rank's previous one
        has_next = np.ones(n, bool)
        has_next[ev.off[1:] - 1] = False
        return ev.off[:-1].astype(np.int64), lambda go: go[has_next[go]] + 1
    prev_ptr, prev_idx = ev.prev_ptr, ev.prev_idx
    held = np.diff(prev_ptr)                         # previous events not yet completed
    po = np.argsort(prev_idx, kind="stable")         # who follows each event
    succ = np.repeat(np.arange(n), held)[po]
    succ_ptr = np.r_[0, np.cumsum(np.bincount(prev_idx, minlength=n))]

    def release(go: np.ndarray) -> np.ndarray:
        nxt, cnt = np.unique(succ[_expand(succ_ptr, go)], return_counts=True)
        held[nxt] -= cnt
        return nxt[held[nxt] == 0]
    return np.flatnonzero(held == 0), release


@dataclass
class _Rounds:
    arrs: list[np.ndarray]    # per round, the events that arrive
    gos: list[np.ndarray]     # per round, the events that complete (an instance's side by side)
    arr_round: np.ndarray     # per event, its arrival round
    go_round: np.ndarray      # per event, its completion round
    stuck: int                # rounds that released a cycle


WIDE = 4      # events with at most this many p2p dependencies look them up in a table, the others in a list


def _rounds(ev: Events) -> _Rounds:
    """Round by round, the events that arrive and those that complete: an event completes in
    the first round by which its p2p dependencies and its instance's members have all
    arrived; a round where none can releases everyone waiting (a cycle in bad data)."""
    n = len(ev.a)
    new, release = _releases(ev)
    has = ev.inst >= 0
    ni = int(ev.inst.max()) + 1 if has.any() else 0
    inst = np.where(has, ev.inst, ni)               # no instance: one more, that never waits
    inst_left = np.bincount(inst, minlength=ni + 1)  # members not arrived yet
    inst_left[ni] = -n
    out = _Rounds([], [], np.full(n + 1, np.iinfo(np.int64).max, np.int64), np.empty(n, np.int64), 0)
    out.arr_round[n] = -1                           # (arrived before any round: an event's missing dependency)
    ndeps = np.diff(ev.dep_ptr)
    wide = np.flatnonzero(ndeps > WIDE)             # their dependencies in the CSR list, the others' in `deps`
    k_max = min(int(ndeps.max(initial=0)), WIDE)
    deps = np.full((n, max(k_max, 1)), n, np.int64)
    narrow = np.repeat(ndeps <= WIDE, ndeps)
    at = np.repeat(np.arange(n), ndeps)[narrow]
    deps[at, _nth(at)] = ev.dep_idx[narrow]
    is_wide = np.zeros(n, bool)
    is_wide[wide] = True
    waiting = np.zeros(0, np.int64)
    k = 0
    while len(new) or len(waiting):
        out.arrs.append(new)
        out.arr_round[new] = k
        np.subtract.at(inst_left, inst[new], 1)
        cur = np.concatenate([waiting, new]) if len(waiting) else new
        got = out.arr_round[deps[cur]]
        ok = (got[:, 0] if k_max <= 1 else got.max(axis=1)) <= k
        ok &= inst_left[inst[cur]] <= 0
        if len(wide):
            cw = np.flatnonzero(is_wide[cur])
            if len(cw):
                ok[cw] &= np.maximum.reduceat(out.arr_round[ev.dep_idx[_expand(ev.dep_ptr, cur[cw])]],
                                              np.r_[0, np.cumsum(ndeps[cur[cw]])[:-1]]) <= k
        if ok.all():
            go, waiting = cur, waiting[:0]
        elif ok.any():
            go, waiting = cur[ok], cur[~ok]
        else:                                   # a cycle in bad data: release everyone waiting
            out.stuck += 1
            go, waiting = cur, waiting[:0]
        go = go[np.argsort(inst[go])]           # an instance's members side by side
        out.gos.append(go)
        out.go_round[go] = k
        new = release(go)
        k += 1
    out.arr_round = out.arr_round[:n]
    return out


def _nth(seg: np.ndarray) -> np.ndarray:
    """Per item of sorted segment ids `seg`, its place in its segment (0, 1, ...)."""
    first = np.r_[True, seg[1:] != seg[:-1]]
    return np.arange(len(seg)) - np.maximum.accumulate(np.where(first, np.arange(len(seg)), 0))


def _own_segments(ev: Events, go: np.ndarray, apos: np.ndarray, rs: _Rounds) -> tuple[np.ndarray, np.ndarray]:
    """Per completing event (in `go` order), the arrival positions of itself, then its p2p
    dependencies arrived by its round: (own_pos, own_ptr)."""
    n = len(go)
    if not len(ev.dep_idx):                        # no p2p dependencies: each event alone
        return apos[go], np.arange(n + 1)
    ndeps = np.diff(ev.dep_ptr)
    q = np.repeat(np.arange(n), ndeps[go])         # completion index of each dependency, in order
    d = ev.dep_idx[_expand(ev.dep_ptr, go)]
    keep = rs.arr_round[d] <= rs.go_round[go[q]]
    q, d = q[keep], d[keep]
    own_ptr = np.r_[0, np.cumsum(1 + np.bincount(q, minlength=n))]
    own_pos = np.empty(int(own_ptr[-1]), np.int64)
    own_pos[own_ptr[:-1]] = apos[go]
    if len(q):
        own_pos[own_ptr[q] + 1 + _nth(q)] = apos[d]
    return own_pos, own_ptr


def _groups(ev: Events, go: np.ndarray, apos: np.ndarray, rs: _Rounds
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The instance groups of the completing events, (round, instance) each, side by side
    in `go`: (grp_pos, grp_ptr, grp_of, grp_rptr) as Schedule keeps them."""
    n = len(go)
    R = len(rs.gos) + 1
    grp_of = np.full(n, -1, np.int64)
    gq = np.flatnonzero(ev.inst[go] >= 0)
    if not len(gq):
        return np.zeros(0, np.int64), np.zeros(1, np.int64), grp_of, np.zeros(R + 1, np.int64)
    has = ev.inst >= 0
    inst_size = np.bincount(ev.inst[has], minlength=int(ev.inst.max()) + 1)
    g_round, g_inst = rs.go_round[go[gq]], ev.inst[go[gq]]
    new_g = np.r_[True, (g_round[1:] != g_round[:-1]) | (g_inst[1:] != g_inst[:-1])]
    gid = np.cumsum(new_g) - 1
    grp_of[gq] = gid
    starts = np.flatnonzero(new_g)
    g_round, g_inst = g_round[starts], g_inst[starts]
    sizes = np.diff(np.r_[starts, len(gq)])
    grp_rptr = np.searchsorted(g_round, np.arange(R + 1))
    # an instance that completes whole in one round (all but a cycle's): its members are
    # its group, side by side in `go`; the others' members join every group of their
    # instance from the round they arrived
    whole = sizes == inst_size[g_inst]
    cnt = np.where(whole, sizes, 0)
    part = np.flatnonzero(~whole)
    if len(part):
        mem_of, pg = _cycle_members(ev, part, g_inst, g_round, rs.arr_round, R)
        cnt += np.bincount(pg, minlength=len(starts))
    grp_ptr = np.r_[0, np.cumsum(cnt)]
    grp_pos = np.empty(int(grp_ptr[-1]), np.int64)
    w = np.flatnonzero(whole[gid])                 # members of whole groups, in `go` order
    grp_pos[grp_ptr[gid[w]] + (w - starts[gid[w]])] = apos[go[gq[w]]]
    if len(part):
        grp_pos[grp_ptr[pg] + _nth(pg)] = apos[mem_of]
    return grp_pos, grp_ptr, grp_of, grp_rptr


def _cycle_members(ev: Events, part: np.ndarray, g_inst: np.ndarray, g_round: np.ndarray,
                   arr_round: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """For the groups `part` of instances that complete over several rounds (a released
    cycle's): every member of such an instance joins each of its groups from the round it
    arrived. Returns (member event, group) pairs, by group."""
    pkey = g_inst[part] * R + g_round[part]
    by = np.argsort(pkey, kind="stable")
    pkey = pkey[by]
    mark = np.zeros(int(ev.inst.max()) + 1, bool)
    mark[g_inst[part]] = True
    mem = np.flatnonzero((ev.inst >= 0) & mark[np.maximum(ev.inst, 0)])
    lo = np.searchsorted(pkey, ev.inst[mem] * R + arr_round[mem])
    hi = np.searchsorted(pkey, ev.inst[mem] * R + R)
    k_mem = hi - lo
    mem_of = np.repeat(mem, k_mem)
    pg = part[by[np.repeat(lo - (np.cumsum(k_mem) - k_mem), k_mem) + np.arange(int(k_mem.sum()))]]
    o = np.argsort(pg, kind="stable")
    return mem_of[o], pg[o]


def schedule(ev: Events) -> Schedule:
    """The rounds of `ev`'s replays (see Schedule), found once and kept on `ev`."""
    if isinstance(ev.schedule, Schedule):
        return ev.schedule
    n = len(ev.a)
    rs = _rounds(ev)
    nr = len(rs.gos)
    arr, go = np.concatenate(rs.arrs), np.concatenate(rs.gos)
    arr_ptr = np.r_[0, np.cumsum([len(a) for a in rs.arrs]), n]     # round k + 1 may have none
    go_ptr = np.r_[0, np.cumsum([len(g) for g in rs.gos])]
    apos = np.empty(n, np.int64)
    apos[arr] = np.arange(n)
    gpos = np.empty(n, np.int64)
    gpos[go] = np.arange(n)
    n0 = len(rs.arrs[0])
    if ev.prev_ptr is None or ev.prev_idx is None:
        arr_prev_ptr = np.r_[np.zeros(n0, np.int64), np.arange(n - n0 + 1)]
        arr_prev_pos = gpos[arr[n0:] - 1]
    else:
        arr_prev_ptr = np.r_[0, np.cumsum(np.diff(ev.prev_ptr)[arr])]
        arr_prev_pos = gpos[ev.prev_idx[_expand(ev.prev_ptr, arr)]]
    own_pos, own_ptr = _own_segments(ev, go, apos, rs)
    grp_pos, grp_ptr, grp_of, grp_rptr = _groups(ev, go, apos, rs)
    grp_rptr = grp_rptr[:nr + 1]
    # per round: its completions' own segments, then its groups'
    own_at, grp_at = own_ptr[go_ptr], grp_ptr[grp_rptr]        # each round's first item of each
    o_cnt, g_cnt = np.diff(own_at), np.diff(grp_at)
    cat_at = np.r_[0, np.cumsum(o_cnt + g_cnt)]
    cat_pos = np.empty(int(cat_at[-1]), np.int64)
    cat_pos[np.arange(len(own_pos)) + np.repeat(cat_at[:-1] - own_at[:-1], o_cnt)] = own_pos
    cat_pos[np.arange(len(grp_pos)) + np.repeat(cat_at[:-1] + o_cnt - grp_at[:-1], g_cnt)] = grp_pos
    q_cnt, n_grp = np.diff(go_ptr), np.diff(grp_rptr)
    seg_at = go_ptr + grp_rptr                                   # each round's first segment
    round_q = np.repeat(np.arange(nr), q_cnt)
    round_g = np.repeat(np.arange(nr), n_grp)
    cat_rel = np.empty(int(seg_at[-1]), np.int64)
    cat_rel[np.arange(n) + grp_rptr[round_q]] = own_ptr[:-1] - own_at[round_q]
    g = np.arange(len(round_g))
    cat_rel[g + go_ptr[round_g + 1]] = o_cnt[round_g] + grp_ptr[g] - grp_at[round_g]
    pick = np.where(grp_of >= 0, q_cnt[round_q] + grp_of - grp_rptr[round_q], np.arange(n) - go_ptr[round_q])
    arr_prev_rel = arr_prev_ptr[:-1] - arr_prev_ptr[arr_ptr[np.repeat(np.arange(nr + 1), np.diff(arr_ptr))]]
    ap = arr_ptr[1:nr + 2]
    single = (np.diff(arr_prev_ptr[ap]) == np.diff(ap)).tolist()
    plan = list(zip(go_ptr[:-1].tolist(), go_ptr[1:].tolist(), cat_at[:-1].tolist(), cat_at[1:].tolist(),
                    seg_at[:-1].tolist(), seg_at[1:].tolist(), ap[:-1].tolist(), ap[1:].tolist(),
                    arr_prev_ptr[ap[:-1]].tolist(), arr_prev_ptr[ap[1:]].tolist(), single))
    big = max(len(cat_pos), n)
    idx = np.int32 if big < np.iinfo(np.int32).max else np.int64   # positions: half the memory
    ev.schedule = Schedule(arr=arr.astype(idx), go=go.astype(idx), arr_prev_pos=arr_prev_pos.astype(idx),
                           arr_prev_rel=arr_prev_rel.astype(idx), cat_pos=cat_pos.astype(idx),
                           cat_rel=cat_rel.astype(idx), pick=pick.astype(idx), plan=plan,
                           stuck_rounds=rs.stuck)
    return ev.schedule


def replay(ev: Events, w: np.ndarray, x: np.ndarray) -> Replayed:
    """Arrivals and ends of every event with own work `w` and transfers `x`: arrival = the
    latest end of the events it follows + own work (none: its measured arrival + own
    work); end = the latest arrival among itself and its dependencies + transfer."""
    n = len(ev.a)
    if n == 0:
        return Replayed(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    s = schedule(ev)
    A = w[s.arr].astype(np.int64)                  # in arrival order
    x_go = x[s.go]
    E = np.empty(n, np.int64)                      # in completion order
    n0 = s.plan[0][6]
    A[:n0] += ev.a[s.arr[:n0]]
    cat_pos, cat_rel, pick, prev_pos, prev_rel = s.cat_pos, s.cat_rel, s.pick, s.arr_prev_pos, s.arr_prev_rel
    top = np.maximum
    for q0, q1, c0, c1, s0, s1, a0, a1, p0, p1, single in s.plan:
        red = top.reduceat(A[cat_pos[c0:c1]], cat_rel[s0:s1])
        e = E[q0:q1]
        top(red[:q1 - q0], red[pick[q0:q1]], out=e)
        e += x_go[q0:q1]
        if a1 > a0:
            if single:                          # one previous event each
                A[a0:a1] += E[prev_pos[p0:p1]]
            else:
                A[a0:a1] += top.reduceat(E[prev_pos[p0:p1]], prev_rel[a0:a1])
    a_out = np.empty(n, np.int64)
    e_out = np.empty(n, np.int64)
    a_out[s.arr] = A
    e_out[s.go] = E
    return Replayed(a_out, e_out, s.stuck_rounds)
