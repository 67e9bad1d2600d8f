"""Steps and roles: where each rank's training step begins and ends, and whom it is compared with.

No collective needs to span every rank. Megatron and FSDP jobs have none: a
data-parallel group per pipeline stage and tensor-parallel position, tensor
groups inside a stage, an embedding group of the first and last stage, the
pipeline's send/recv. A *marker* is a recurring collective (one communicator's
one op); the markers of one *family* (same op, same group size, about as many
instances) together cover ranks, e.g. every data-parallel group's gradient
reduce-scatter. A family made at one end of the trace only (a DDP job's broadcasts
at start-up, a checkpoint's at the end: its n instances span less than half of
(n - 1) / n of the longest span of a family sharing a member with it) is none, unless
nothing else recurs. The family chosen recurs least (once per step; seen at least
MIN_INSTANCES times), then covers the most ranks, then spans the widest groups; a
family made only every few steps (a loss reduced for logging every N steps) is none
(``_every_few_steps``), and its calls take slots of their own after the step's; a
marker that recurs several times per step (FSDP's per-layer reduce-scatter) marks
every q-th step boundary, q from the period of its ranks' own call sequence;
ranks it leaves out are covered by other families that recur as often, then
through what connects them to covered ranks (``_propagate``: a pure pipeline's
middle stages get their steps from the send/recv they exchange with the first
and last stage, which share an embedding group). A rank's step k runs from just
after its k-th marker instance to its (k+1)-th.

The step numbers of different markers are aligned by time (each marker's
instances against the reference marker's, at the offset that brings them
closest), and the window is the run of whole steps that every marker holds.
A rank's role is its pipeline stage (from the communicators used only for
send/recv between neighbours, ring neighbours included); peers are compared
within a role.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ingero.analysis.calls import Calls, Events, _RECV, _SEND
from ingero.analysis.replay import Measured

ALIKE_COUNT = 1.25        # markers of one family recur within 25% as often (edges of a late or cut trace)
MIN_INSTANCES = 3         # a marker seen fewer times is one only when nothing else recurs
MAX_OFFSET_STEPS = 8      # markers are aligned by at most this many steps against the reference
MAX_PERIOD = 64           # a marker recurs at most this many times per step (an FSDP job: once per layer)
PERIOD_MATCH = 0.9        # share of windows that must repeat for a period (the edges of a cut trace may not)
FORWARD_EVENTS = 2.0      # an FSDP forward holds every layer's gather: L + 1 (>= 2) times a backward layer's


@dataclass
class Timeline:
    """What the verdict works on: events, their measurement, roles and the step window."""

    ev: Events
    m: Measured
    role: np.ndarray          # per event: the rank's role (pipeline stage, 0 without one)
    key: np.ndarray           # per event: (role, step, ordinal) as one integer, -1 outside the window
    inwin: np.ndarray         # per event: inside the whole-step window
    marker_inst: np.ndarray   # (markers, steps + 1): each marker's instance at each step boundary
    steps: int                # whole steps in the window
    stage_of: dict            # rank -> stage (pipelines only)
    since: np.ndarray | None = None   # per event: its ordinal since the rank's last marker
    slots: int = 1                    # ordinals per step (bound)
    covered: list | None = None       # the ranks inside the window (None: every rank)
    boundary: np.ndarray | None = field(default=None, repr=False)   # events of the boundary instances

    def marker_ends(self, E: np.ndarray) -> np.ndarray:
        """(markers, steps + 1): the end of each boundary instance, for event ends E."""
        ni = int(self.ev.inst.max()) + 1
        if self.boundary is None:
            mark = np.zeros(ni, bool)
            mark[np.ravel(self.marker_inst)] = True
            self.boundary = np.flatnonzero((self.ev.inst >= 0) & mark[np.maximum(self.ev.inst, 0)])
        ends = np.full(ni, np.iinfo(np.int64).min, np.int64)
        np.maximum.at(ends, self.ev.inst[self.boundary], E[self.boundary])
        return ends[np.atleast_2d(self.marker_inst)]

    def step_ns(self, E: np.ndarray) -> float:
        """The job's step for event ends E: per marker, (end of its last boundary instance -
        end of its first) / steps; the slowest marker's (the job waits for it)."""
        if not self.steps:
            return 0.0
        me = self.marker_ends(E)
        return float((me[:, -1] - me[:, 0]).max()) / self.steps

    def step_bounds(self, E: np.ndarray, k: int) -> tuple[int, int]:
        """[the earliest marker end at boundary k, the latest at boundary k + 1]."""
        me = self.marker_ends(E)
        return int(me[:, k].min()), int(me[:, k + 1].max())

    def first_arrivals(self) -> np.ndarray:
        """(markers, steps + 1): each boundary instance's earliest arrival."""
        ev = self.ev
        first = ev.per_inst(np.minimum, ev.a, np.iinfo(np.int64).max)
        return first[np.atleast_2d(self.marker_inst)]


def stages(c: Calls) -> dict:
    """rank -> pipeline stage, from communicators used only for send/recv between neighbours
    (PyTorch/Megatron: one p2p group per pipeline, ordered by stage; an interleaved schedule
    also sends from the last stage to the first)."""
    sel = ((c.op == _SEND) | (c.op == _RECV)) & (c.peer >= 0)   # p2p calls whose peer is known
    if not sel.any():
        return {}
    has_coll = np.zeros(len(c.comm_hash), bool)
    has_coll[c.comm[c.inst >= 0]] = True
    out: dict = {}
    comm, rank, peer = c.comm[sel], c.rank[sel], c.peer[sel]
    o = np.argsort(comm, kind="stable")
    comm, rank, peer = comm[o], rank[o], peer[o]
    bounds = np.flatnonzero(np.r_[True, comm[1:] != comm[:-1], True])
    pos = np.full(int(max(rank.max(initial=0), peer.max(initial=0))) + 1, -1, np.int64)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        k = int(comm[lo])
        mem = c.comm_members.get(k, [])
        if has_coll[k] or len(mem) < 2:
            continue
        pos[:] = -1
        pos[[g for g in mem if g < len(pos)]] = [i for i, g in enumerate(mem) if g < len(pos)]
        me, pe = pos[rank[lo:hi]], pos[peer[lo:hi]]
        hop = np.where((me >= 0) & (pe >= 0), np.abs(me - pe), 0)
        if np.mean((hop == 1) | ((hop == len(mem) - 1) & (len(mem) > 2))) >= 0.95:
            for i, g in enumerate(mem):
                out.setdefault(g, i)
    return out


def markers(c: Calls, visible: np.ndarray, ev: Events | None = None) -> list[tuple[int, int]]:
    """The markers, as [(communicator code, op code)], the reference first; [] when no
    collective recurs. `visible`: per instance, whether it is a sync event of its own (a
    collective inside a group is not). With the events `ev`, a family made only every few
    steps (``_every_few_steps``) is no marker."""
    if not visible.any():
        return []
    code = c.inst_comm[visible] * 64 + c.inst_op[visible]
    n = np.bincount(code)
    size = np.zeros(len(n), np.int64)
    np.maximum.at(size, code, c.inst_size[visible])
    by_shape: dict = {}
    for k in np.flatnonzero(n >= 2).tolist():
        by_shape.setdefault((k % 64, int(size[k])), []).append((int(n[k]), k // 64))
    families = []                     # (op, size, [(instances, comm)])
    for (op, sz), lst in by_shape.items():
        lst.sort()
        cur = [lst[0]]
        for item in lst[1:]:
            if item[0] > ALIKE_COUNT * cur[0][0]:
                families.append((op, sz, cur))
                cur = []
            cur.append(item)
        families.append((op, sz, cur))
    if not families:
        return []

    def members(fam) -> set:
        return set().union(*(c.comm_members.get(comm, []) for _, comm in fam[2]))

    def count(fam) -> float:
        return float(np.median([k for k, _ in fam[2]]))

    def order(fam, want: set):
        """Fewest instances (once per step), most of `want` covered, widest groups, then a
        stable tie-break."""
        return (count(fam), -len(members(fam) & want), -fam[1], fam[0],
                min(int(c.comm_hash[comm]) for _, comm in fam[2]))

    at = np.flatnonzero(c.inst >= 0)                  # when each collective's calls begin and end
    at = at[visible[c.inst[at]]]
    kind = c.inst_comm[c.inst[at]] * 64 + c.inst_op[c.inst[at]]
    lo, hi = np.full(len(n), np.iinfo(np.int64).max), np.full(len(n), np.iinfo(np.int64).min)
    np.minimum.at(lo, kind, c.t[at])
    np.maximum.at(hi, kind, c.t[at])

    def span(fam) -> int:
        k = [comm * 64 + fam[0] for _, comm in fam[2]]
        return int(hi[k].max() - lo[k].min())

    def throughout(fam) -> bool:
        """Whether a family recurs through its members' time, not only at one end of it (a
        DDP job's broadcasts at start-up): its n instances span half of (n - 1) / n of the
        longest span of a family sharing a member with it at least."""
        whole = max((span(f) for f in families if members(f) & members(fam)), default=0)
        return 2 * count(fam) * span(fam) >= (count(fam) - 1) * whole

    left = set(np.unique(c.rank).tolist())
    families = [f for f in families if throughout(f)] or families
    # a collective seen only twice may be a one-off pair (set-up, checkpoint): a step needs 3
    steady = [f for f in families if count(f) >= MIN_INSTANCES] or families
    if ev is not None:
        most = max(count(f) for f in steady)
        steady = [f for f in steady if count(f) * 2 > most or not _every_few_steps(c, ev, f[0], f[2])] or steady
    chosen = [min(steady, key=lambda f: order(f, left))]
    left -= members(chosen[0])
    n_ref = count(chosen[0])
    while left:
        alike = [f for f in families if f not in chosen and members(f) & left
                 and n_ref / ALIKE_COUNT <= count(f) <= n_ref * ALIKE_COUNT]
        if not alike:
            break
        chosen.append(min(alike, key=lambda f: (-len(members(f) & left), *order(f, left))))
        left -= members(chosen[-1])
    return [(comm, op) for op, _, lst in chosen
            for _, comm in sorted(lst, key=lambda t: (-t[0], int(c.comm_hash[t[1]])))]


def _kind(c: Calls, inst: np.ndarray) -> np.ndarray:
    """Per event of instance `inst`: its collective's communicator and op as one number; -1
    for none (a send/recv)."""
    i = np.maximum(inst, 0)
    return np.where(inst >= 0, c.inst_comm[i] * 64 + c.inst_op[i], -1)


def _every_few_steps(c: Calls, ev: Events, op: int, fam: list) -> bool:
    """Whether a family of collectives (`op` on the communicators of `fam`) is made only every
    few steps, as a loss reduced for logging every N steps is: on every traced member, the
    sync events between two of its instances are one sequence of two kinds or more repeated
    k >= 2 times (in at least PERIOD_MATCH of those windows), and those events connect every
    member. A step is more than one kind of call repeated (a tensor-parallel all-reduce per
    microbatch, a data-parallel bucket's all-reduce), and it is the whole job's: between two
    data-parallel reduce-scatters a tensor-parallel group's all-reduces repeat too, but
    connect no replicas."""
    comms = [comm for _, comm in fam]
    ids = np.flatnonzero(np.isin(c.inst_comm, comms) & (c.inst_op == op))
    traced = set(ev.ranks.tolist())
    mem = sorted(set().union(*(c.comm_members.get(comm, []) for comm in comms)) & traced)
    if len(mem) < 2:
        return False
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    def join(group: Iterable[int]) -> None:
        roots = {find(g) for g in group}
        for r in roots:
            parent[r] = min(roots)

    kind = _kind(c, ev.inst)
    src = np.repeat(np.arange(len(ev.a)), np.diff(ev.dep_ptr))
    comms_used: set[int] = set()
    pairs: set[tuple[int, int]] = set()
    for r in mem:
        k = int(np.searchsorted(ev.ranks, r))
        lo, hi = int(ev.off[k]), int(ev.off[k + 1])
        at = lo + np.flatnonzero(np.isin(ev.inst[lo:hi], ids))
        if len(at) < 2:
            continue
        repeated = 0
        for a, b in zip(at[:-1].tolist(), at[1:].tolist()):
            w = kind[a + 1:b]
            n = len(w)
            p = next((p for p in range(1, n // 2 + 1) if n % p == 0 and np.array_equal(w[p:], w[:-p])), 0)
            repeated += p > 0 and len(np.unique(w[:p])) >= 2
        if repeated < PERIOD_MATCH * (len(at) - 1):
            return False
        inner = ev.inst[at[0] + 1:at[-1]]
        comms_used.update(np.unique(c.inst_comm[inner[inner >= 0]]).tolist())
        d = (src > at[0]) & (src < at[-1])
        pairs.update(zip(ev.rank[src[d]].tolist(), ev.rank[ev.dep_idx[d]].tolist()))
    if not comms_used and not pairs:
        return False
    for comm in comms_used:
        join(c.comm_members.get(comm, []))
    for pair in pairs:
        join(pair)
    return len({find(r) for r in mem}) == 1


def _whole_steps(c: Calls, ev: Events, ids: np.ndarray, comm: int) -> np.ndarray:
    """A marker's instances (`ids`, in order) that end steps: all of them, or every q-th when
    the marker recurs q times per step, as an FSDP job's per-layer reduce-scatter does. Told
    from a member's own call sequence: the kinds of sync events (communicator and op, or a
    send/recv) between consecutive marker instances repeat with period q (in at least
    PERIOD_MATCH of the windows) and not with any shorter one, and one window of the period
    holds FORWARD_EVENTS times the events of the median one (the forward, with every
    layer's gather). Kinds the member makes less often than the marker (a loss logged every
    few steps) are left out of the windows' kinds. A step ends with the instance before that
    window."""
    traced = set(ev.ranks.tolist())
    mem = [r for r in c.comm_members.get(comm, []) if r in traced]
    if not mem or len(ids) < 3:
        return ids
    k = int(np.searchsorted(ev.ranks, mem[0]))
    lo, hi = int(ev.off[k]), int(ev.off[k + 1])
    inst = ev.inst[lo:hi]
    j = np.flatnonzero(np.isin(inst, ids))           # the member's marker events, and their place in ids
    if len(j) < 3:
        return ids
    order = np.argsort(ids, kind="stable")
    at = list(zip(j.tolist(), order[np.searchsorted(ids[order], inst[j])].tolist()))
    kind = _kind(c, inst)
    _, which, n = np.unique(kind, return_inverse=True, return_counts=True)
    often = n[which] * ALIKE_COUNT >= len(j)                       # as often as the marker, or more
    sig = [tuple(kind[a + 1:b][often[a + 1:b]].tolist()) for (a, _), (b, _) in zip(at[:-1], at[1:])]
    seen: dict = {}
    code = np.array([seen.setdefault(x, len(seen)) for x in sig], np.int64)   # a number per distinct window
    length = np.array([len(x) for x in sig], np.float64)
    for q in range(1, min(MAX_PERIOD, (len(sig) - 1) // 2) + 1):
        if np.mean(code[:-q] == code[q:]) < PERIOD_MATCH:
            continue
        if q == 1:
            return ids
        size = [float(np.median(length[j::q])) for j in range(q)]
        longest = int(np.argmax(size))
        if size[longest] >= FORWARD_EVENTS * max(float(np.median(size)), 1.0):
            return ids[at[longest][1] % q::q]
    return ids


def _align(first: list[np.ndarray]) -> list[int]:
    """Step offset of each marker's instances (first arrivals, in order) against the first
    marker's: the shift that brings them closest in time."""
    ref = first[0]
    out = [0]
    for t in first[1:]:
        best = None
        K = min(MAX_OFFSET_STEPS, max(len(t), len(ref)) - 1)
        for k in range(-K, K + 1):
            # marker instance i sits at reference step i + k
            lo, hi = max(0, -k), min(len(t), len(ref) - k)
            if hi - lo < 1:
                continue
            cost = float(np.median(np.abs(t[lo:hi] - ref[lo + k:hi + k])))
            if best is None or cost < best[0]:
                best = (cost, k)
        out.append(best[1] if best else 0)
    return out


def _marker_runs(c: Calls, ev: Events, first: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
    """Each marker's boundary instances in order of first arrival (whole steps only: see
    ``_whole_steps``), and its communicator; markers seen fewer than twice left out. Those at
    either end holding fewer calls than its fullest are left out too: cut by the trace's or
    the window's edge, their end waits on calls it does not hold (the last rank to arrive,
    often the straggler), which no replay can move. `first`: every instance's earliest
    member arrival (int64 max: none)."""
    seen = first < np.iinfo(np.int64).max
    per, used = [], []
    for comm, op in markers(c, seen, ev):
        ids = np.flatnonzero((c.inst_comm == comm) & (c.inst_op == op) & seen)
        ids = _whole_steps(c, ev, ids[np.argsort(first[ids], kind="stable")], comm)
        full = np.flatnonzero(c.inst_size[ids] == c.inst_size[ids].max(initial=0))
        if len(full) and full[-1] > full[0]:
            per.append(ids[full[0]:full[-1] + 1])
            used.append(comm)
    return per, used


def _steps_before(c: Calls, ev: Events, per: list[np.ndarray], used: list[int], off: list[int],
                  seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per event, the reference steps its rank began before it (-1: unknown), and the last
    event at or before it that opens a step on its rank (-1: none). Each rank follows one
    marker, the first that holds it; ranks no marker holds get theirs through
    ``_propagate``."""
    nr = len(ev.ranks)
    has = ev.inst >= 0
    rank_mk = np.full(nr, -1, np.int64)
    for g in range(len(per) - 1, -1, -1):
        mem = np.array(c.comm_members.get(used[g], []), np.int64)
        rank_mk[np.isin(ev.ranks, mem)] = g
    mk_of = np.full(len(c.inst_size), -1, np.int64)
    for g, p in enumerate(per):
        mk_of[p] = g
    is_mk = has & (mk_of[np.maximum(ev.inst, 0)] == rank_mk[seg]) & (rank_mk[seg] >= 0)
    cs = np.cumsum(is_mk)
    base = np.r_[0, cs][ev.off[:-1]]
    before = cs - is_mk - base[seg]                        # the rank's markers strictly before
    # the rank's first marker instance is its marker's step (its position there + offset)
    pos = np.zeros(len(c.inst_size), np.int64)
    for o, p in zip(off, per):
        pos[p] = np.arange(len(p)) + o
    first_mk = np.full(nr, -1, np.int64)
    idx_mk = np.flatnonzero(is_mk)
    who, at = np.unique(seg[idx_mk], return_index=True)
    first_mk[who] = idx_mk[at]
    covered_k = first_mk >= 0
    start = np.where(covered_k, pos[ev.inst[np.maximum(first_mk, 0)]], 0)
    gb = np.where(covered_k[seg], before + start[seg], -1)   # markers strictly before, as reference steps
    idx = np.arange(len(ev.a))
    last_mk = np.maximum.accumulate(np.where(is_mk, idx, -1))
    if not covered_k.all():
        gb, opened = _propagate(ev, gb, covered_k, seg)
        last_mk = np.maximum.accumulate(np.where(is_mk | opened, idx, -1))
    return gb, last_mk


def _ordinals(c: Calls, ev: Events, per: list[np.ndarray], seg: np.ndarray, last_mk: np.ndarray,
              inwin: np.ndarray) -> np.ndarray:
    """Per event, its ordinal since its rank's last step opening (before the first: 10**6
    past the rank's start). A collective made less often than once per step (a loss logged
    every few steps) takes no ordinal from the events after it, and has slots of its own
    after the step's."""
    has = ev.inst >= 0
    idx = np.arange(len(ev.a))
    rank_start = ev.off[:-1][seg]
    since = np.where(last_mk >= rank_start, idx - last_mk, idx - rank_start + 10**6)
    code = c.inst_comm * 64 + c.inst_op
    rare = has & (np.bincount(code)[code][np.maximum(ev.inst, 0)] * ALIKE_COUNT < min(len(p) for p in per))
    if rare.any():
        after_mk = last_mk >= rank_start
        reg = np.cumsum(~rare)
        since = np.where(after_mk, reg - reg[np.maximum(last_mk, 0)], since)
        top = int(since[after_mk & ~rare & inwin].max(initial=0)) + 1
        since = np.where(after_mk & rare, top + since, since)
    return since


def timeline(c: Calls, ev: Events, m: Measured) -> Timeline | None:
    """The step window from the markers (see the module's docstring); None without two whole
    boundaries common to every marker."""
    has = ev.inst >= 0
    if not has.any():
        return None
    # every instance's earliest member event; instances with none are no sync event
    first = ev.per_inst(np.minimum, ev.a, np.iinfo(np.int64).max, len(c.inst_size))
    per, used = _marker_runs(c, ev, first)
    if not per:
        return None
    off = _align([first[p] for p in per])
    L = max(off)                                           # the window: reference steps L..H
    H = min(o + len(p) - 1 for o, p in zip(off, per))
    steps = H - L
    if steps < 1:
        return None
    marker_inst = np.stack([p[L - o:H - o + 1] for o, p in zip(off, per)])
    nr = len(ev.ranks)
    seg = np.repeat(np.arange(nr), np.diff(ev.off))
    gb, last_mk = _steps_before(c, ev, per, used, off, seg)
    covered_k = np.bincount(seg[gb >= 0], minlength=nr) > 0
    inwin = (gb >= L + 1) & (gb <= H)
    since = _ordinals(c, ev, per, seg, last_mk, inwin)
    stage_of = stages(c)
    role = np.array([stage_of.get(int(r), 0) for r in ev.ranks.tolist()], np.int64)[seg]
    # one small integer per (role, step, ordinal) inside the window, -1 outside
    step_no = gb - L
    B = int(step_no[inwin].max()) + 1 if inwin.any() else 1
    S = int(since[inwin].max()) + 1 if inwin.any() else 1
    key = np.where(inwin, (role * B + step_no) * S + since, -1)
    covered = sorted(ev.ranks[covered_k].tolist())
    return Timeline(ev=ev, m=m, role=role, key=key, inwin=inwin, marker_inst=marker_inst, steps=steps,
                    stage_of=stage_of, since=since, slots=S,
                    covered=None if len(covered) == nr else covered)


def _propagate(ev: Events, gb: np.ndarray, covered: np.ndarray, seg: np.ndarray):
    """Steps for the ranks no marker holds, through what connects them to ranks with steps:
    a send/recv pair or a collective instance shares its step (a recv of step k's
    activations is in the receiver's step k). A rank's events take the latest step linked so
    far (steps never go back), rank after rank until nothing changes. Returns (step of every
    event, -1 unknown; the events that open a step on a propagated rank)."""
    gb = gb.copy()
    n = len(gb)
    src = np.repeat(np.arange(n), np.diff(ev.dep_ptr))
    dst = ev.dep_idx
    has = ev.inst >= 0
    ni = int(ev.inst.max()) + 1 if has.any() else 0
    done = covered.copy()
    opened = np.zeros(n, bool)
    while not done.all():
        known = done[seg]
        cand = np.full(n, -1, np.int64)
        for a, b in ((src, dst), (dst, src)):
            m = known[b] & ~known[a] & (gb[b] >= 0)
            np.maximum.at(cand, a[m], gb[b[m]])
        if ni:
            step = np.full(ni, -1, np.int64)
            m = has & known & (gb >= 0)
            np.maximum.at(step, ev.inst[m], gb[m])
            m = has & ~known
            cand[m] = np.maximum(cand[m], step[ev.inst[m]])
        new = np.bincount(seg[cand >= 0], minlength=len(done)) > 0
        new &= ~done
        if not new.any():
            break
        for k in np.flatnonzero(new).tolist():
            lo, hi = ev.off[k], ev.off[k + 1]
            run = np.maximum.accumulate(cand[lo:hi])
            gb[lo:hi] = run
            opened[lo:hi] = (run >= 0) & (run != np.r_[-1, run[:-1]])
        done |= new
    return gb, opened


def _per_rank(tl: Timeline, values: np.ndarray) -> dict[int, float]:
    """Per covered rank: the sum of `values` over its events in the window, per step."""
    ev = tl.ev
    sel = tl.inwin
    seg = np.repeat(np.arange(len(ev.ranks)), np.diff(ev.off))       # events come rank by rank
    tot = np.bincount(seg[sel], weights=values[sel], minlength=len(ev.ranks))
    keep = set(tl.covered) if tl.covered is not None else None
    return {int(r): float(v) / tl.steps for r, v in zip(ev.ranks.tolist(), tot.tolist())
            if keep is None or r in keep}


def own_per_rank(tl: Timeline, w: np.ndarray) -> dict[int, float]:
    """Own work per step of each covered rank."""
    return _per_rank(tl, w.astype(np.float64))


def wait_per_rank(tl: Timeline) -> dict[int, float]:
    """Time blocked on other ranks per step of each covered rank."""
    return _per_rank(tl, (tl.m.ready - tl.ev.a).astype(np.float64))
