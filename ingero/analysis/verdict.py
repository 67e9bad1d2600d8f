"""The straggler verdict: candidates, each replayed, and the one that saves most.

Candidates (``Candidate``): a single rank (its own work set to its role peers'
median at each position of the step), a pipeline stage (its ranks' own work
scaled to the other stages'), a node (all its ranks fixed), the network of a
node (transfers with that node's retransmits in flight set to the clean
median), and "spread" (every rank fixed at once). The saving of each is
measured step minus replayed step, so it is never more than the step.
Nobody is named below SAVING_FLOOR_PCT; "spread" is named when the best single
fix removes less than SPREAD_SHARE of what fixing everyone would and ranks working
longer for whole steps account for it (not the jitter of single sync events), unless
that fix is a rank whose own off-CPU time (I/O, CPU starvation) explains its excess.

One rule per candidate kind (``_rank_candidates``, ``_starved_candidate``,
``_stage_candidate``, ``_node_candidates``, ``_network_candidates``,
``_spread_candidate``), then the arbiter (``_arbitrate``, ``_named``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ingero.analysis.model import Rows, Straggler
from ingero.analysis.proxy import ProxySends, proxy_network, transport_note
from ingero.analysis.replay import Replayed, replay
from ingero.analysis.stats import (NetworkHit, RdmaPort, Retransmits, RunqTails, median_of_others, quantile_at,
                                   robust_z)
from ingero.analysis.steps import Timeline, own_per_rank

# Naming: how much a fix must save, and when "spread" is named instead of one rank or group.
SAVING_FLOOR_PCT = 5.0        # a named rank or group saves >= 5% of the step; less is no fix worth naming
SPREAD_FLOOR_PCT = 12.0       # "fix everyone" needs more: capping every sync event at its slot's median
                              # also removes jitter, 5-8% of the step on a busy machine (a clean FSDP job,
                              # ~20 sync events per rank and step, reaches 14.3-16.9%: hence `_persistent`)
SPREAD_SHARE = 0.5            # spread: the best single fix removes under half of what "fix everyone" does
OFFCPU_CAUSES = ("io", "cpu-contention")   # a rank with one of these of its own outweighs spread and network
TIE_SHARE = 0.9               # a rank saving >= 90% of its group's saving is named instead (more specific)
STARVED_SHARE = 0.5           # an off-CPU-explained rank saving >= 50% of the network fix is the cause
# Network: where the loss is.
RETX_MIN = 3                  # fewer retransmits inside transfer windows than this is no cause
RETX_SHARE = 0.67             # the node (or rank) holding >= 2/3 of them is where the loss is
RETX_MIN_EVENT_SHARE = 0.05   # ... and they hit >= 5% of the sync events
# Off-CPU causes: a rank's off-CPU time of one reason, an outlier among the ranks (`_offcpu_cause`).
OFFCPU_Z = 3.5                # robust z of an outlier
OFFCPU_FLOOR_MS = 10.0        # scale floor when the peers agree closely: 10 ms over the session,
OFFCPU_FLOOR_SHARE = 0.1      # ... 10% of the excess own work it would explain,
OFFCPU_FLOOR_TRACED = 0.002   # ... 0.2% of the traced time (a long session's scattered waits are no outlier)
OFFCPU_EXPLAINS = 0.3         # I/O wait names io covering >= 30% of the excess own work (its write path is
                              # CPU work of its own: io-stall victims' I/O wait, blocked and then runnable
                              # until they run, covers 47-90% at load averages of 30-49)
OFFCPU_EXPLAINS_RUNQUEUE = 0.5  # runqueue wait names cpu-contention covering >= 50%: a starved rank waits
                              # longer than its excess (cpu-hog victims: 225-238%), a slow rank beside a busy
                              # neighbour waits more too (slow-rank victims: 14-23%, once over 30%)
OFFCPU_EXPLAINS_WEAK = 0.15   # a second reason covering >= 15% is weighed against the first by its
                              # multiple of the peers' median
STARVED_PER_WAIT = 4.0        # starved: each wait for a CPU after off-CPU is >= 4x the peers' median
                              # (cpu-hog victims: 7.7-41x); a rank only woken more often, or working longer,
                              # waits more in total but not per wait (lossy-link senders 0.9-2.3x, io-stall
                              # 0.5-1.6x, slow-rank 1.2-1.7x, clean and imbalance <= 1.7x). Below it, the
                              # runqueue wait inside the rank's own work (`runq_in_own_work`) beyond its
                              # peers' rate (`_own_runq`) names cpu-contention at OFFCPU_EXPLAINS_RUNQUEUE of
                              # the excess (cpu-hog victims 1.0-3.3; slow-rank and io-stall 0-0.11, at load
                              # 30 too, where the peers' median gave a slow rank 0.72), but outweighs
                              # neither a network nor a spread verdict (`_own_offcpu`): a lossy link's sender
                              # (1.3-2.4) and a busy machine's most imbalanced rank (1.0-2.3) hold as much
# Candidates replayed.
CANDIDATE_RANKS = 3           # the ranks with the largest excess own work
CANDIDATE_NODES = 2           # slow nodes, the slowest first
NODE_SLOW = 1.05              # a node is slow when each of its ranks works >= 1.05x its reference
NODE_ALIKE = 0.7              # ... and the least slow has >= 70% of the slowest one's excess (a slow
                              # machine slows its ranks alike; two slow ranks of unequal excess are two ranks)


class WhatIf(NamedTuple):
    """A candidate's replay: the step replayed with its fix, and the transfer times used."""

    rep: Replayed
    x: np.ndarray


class Saving(NamedTuple):
    """What a fix saves per step (ns), and its replay (None: not replayed, it could not win)."""

    ns: float
    whatif: WhatIf | None


class OwnWork(NamedTuple):
    """A rank's own work per step against its peers' median, ns."""

    own: float
    peers: float


class Loss(NamedTuple):
    """The retransmits behind a network candidate: `n` of `total` on `node`'s connections,
    `owned` of them on `rank`'s (None: no owner known)."""

    n: int
    total: int
    node: str
    rank: int | None
    owned: int | None

    def text(self) -> str:
        own = f" (rank {self.rank} owns {self.owned})" if self.owned is not None else ""
        return f"{self.n} of {self.total} retransmits inside transfers are on {self.node}'s connections{own}"


@dataclass
class Candidate:
    kind: str                 # rank | stage | node | network | spread
    ranks: list
    saving_ns: float
    label: str
    cause: str = "compute/unknown"
    why: str = ""
    score: float = 0.0
    whatif: WhatIf | None = None      # its replay (None: not replayed)
    own: OwnWork | None = None        # a rank: its own work and its peers'
    net: NetworkHit | None = None     # a network candidate: where the loss is
    worst: int | None = None          # spread: the rank with the most excess own work
    notes: list = field(default_factory=list)   # what it was weighed against, said after `why`

    def text(self) -> str:
        """The evidence sentence: why, then what it was weighed against."""
        return self.why + "".join(f"; {n}" for n in self.notes)


@dataclass
class Decision:
    """The verdict and what it worked on."""

    straggler: Straggler | None
    base_step_ns: float       # the measured step, replayed
    base: Replayed            # the measured timeline, replayed
    timeline: Timeline
    best: Candidate | None = None       # the best single fix, named or not
    named: Candidate | None = None
    candidates: list = field(default_factory=list)
    work_step_ns: float = 0.0           # the step the ranks' own work less its waits for a CPU replays to
                                        # (spread's floors are shares of it; the measured step without waits)

    @property
    def best_saving_pct(self) -> float:
        return 100.0 * self.best.saving_ns / self.base_step_ns if self.best else 0.0

    @property
    def shown(self) -> Candidate | None:
        """The candidate a picture replays: the named one, else the best."""
        return self.named or self.best


class _Replayer:
    """Replays fixes against the measured step; a fix that removes less work than the best
    saving so far (or than `need`) cannot save more and is not replayed."""

    def __init__(self, tl: Timeline, base_step: float):
        self.tl, self.base_step, self.best_ns = tl, base_step, 0.0
        self._edges: tuple | None = None

    def cut_steps_too(self, w: np.ndarray) -> np.ndarray:
        """Own work `w`, a fix of the measured inside the whole steps, with each rank's work in
        the cut steps at the window's edges scaled as its fix scales its work inside. A marker
        whose boundaries fall elsewhere in the step than a rank's own (a later stage's, against
        a stage-0 rank's backward) holds part of that rank's cut steps between its boundaries,
        and the saving a fix of the whole steps only loses there does not shrink with more
        steps."""
        tl, m = self.tl, self.tl.m
        if self._edges is None:        # each event's rank, the work inside per rank, the events outside
            seg = np.repeat(np.arange(len(tl.ev.ranks)), np.diff(tl.ev.off))
            edge = np.flatnonzero(~tl.inwin)
            was = np.bincount(seg[tl.inwin], weights=m.w[tl.inwin], minlength=len(tl.ev.ranks))
            self._edges = seg, was, edge, seg[edge]
        seg, was, edge, edge_rank = self._edges
        fixed = np.flatnonzero(w != m.w)
        cut = np.bincount(seg[fixed], weights=(m.w - w)[fixed], minlength=len(was))
        share = np.divide(was - cut, was, out=np.ones(len(was)), where=was > 0)
        out = w.copy()
        out[edge] = m.w[edge] * share[edge_rank]
        return out

    def removed(self, w: np.ndarray | None, x: np.ndarray | None) -> float:
        """Work taken out per step: no replay can save more (a path holds each event once)."""
        m, win = self.tl.m, self.tl.inwin
        tot = float((m.w - w)[win].sum()) if w is not None else 0.0
        tot += float((m.x - x)[win].sum()) if x is not None else 0.0
        return tot / self.tl.steps

    def saving(self, w: np.ndarray | None = None, x: np.ndarray | None = None, need: float = 0.0,
               alone: bool = False) -> Saving:
        """`alone`: judged against `need` only, not the best so far."""
        bar = need if alone else max(self.best_ns, need)
        if bar > 0 and self.removed(w, x) < bar:
            return Saving(0.0, None)
        m = self.tl.m
        xs = m.x if x is None else x
        r = replay(self.tl.ev, m.w if w is None else self.cut_steps_too(w), xs)
        ns = self.base_step - self.tl.step_ns(r.e)
        self.best_ns = max(self.best_ns, ns)
        return Saving(ns, WhatIf(r, xs))


@dataclass
class _Job:
    """What every rule reads: the timeline, the rows, each rank's own work against its peers'."""

    tl: Timeline
    rows: dict
    traced_ns: int
    base_step: float
    fixed_w: np.ndarray       # each event's own work at most its role peers' median at its position
    slot: np.ndarray          # each event's (role, ordinal since the step marker), -1 outside the window
    own: dict                 # rank -> own work per step
    peers_own: dict           # rank -> its role peers' median of that
    own_z: dict
    own_rq: dict | None       # rank -> runqueue wait inside its own work per step (`runq_in_own_work`)
    work: np.ndarray          # each event's own work less the runqueue wait inside it (`runq_in_events`)
    work_step: float          # the step that replays to
    replayer: _Replayer

    @property
    def excess(self) -> dict:
        return {r: self.own[r] - self.peers_own[r] for r in self.own}

    def own_work(self, r: int) -> OwnWork:
        return OwnWork(self.own.get(r, 0.0), self.peers_own.get(r, 0.0))

    def pct(self, k: Candidate) -> float:
        return 100.0 * k.saving_ns / self.base_step


def decide(tl: Timeline, rows: Rows, retx: Retransmits, traced_ns: int, tails: RunqTails | None = None,
           rdma: list | None = None, local_retx: int = 0, proxy: ProxySends | None = None) -> Decision:
    """The verdict and what it worked on.

    `retx`: the retransmits judged for a lossy link; `local_retx`: those left out because their
    connection stays inside a node. `tails`: the runqueue tails of the ranks' off-CPU intervals
    (`stats.runqueue_tails`); without them only the per-wait test names cpu-contention.
    `rdma`: the RDMA ports whose loss or congestion counters rose (`stats.rdma_ports`).
    `proxy`: the plugin's send ProxyOps (`proxy.proxy_sends`)."""
    base = replay(tl.ev, tl.m.w, tl.m.x)
    d = Decision(None, tl.step_ns(base.e), base, tl)
    if d.base_step_ns <= 0:
        return d
    j = _job(tl, rows, traced_ns, tails, d.base_step_ns)
    d.work_step_ns = j.work_step
    found = [*_rank_candidates(j), _starved_candidate(j), _stage_candidate(j), *_node_candidates(j),
             *_network_candidates(j, retx, rdma, proxy)]
    cands = sorted((k for k in found if k is not None), key=lambda k: -k.saving_ns)
    spread = _spread_candidate(j)
    d.candidates = [*cands, spread]
    d.best = _arbitrate(j, cands, retx, local_retx)
    d.named = _named(j, d.best, spread)
    if d.named is not None:
        d.straggler = _straggler(d.named, j, base)
    return d


def _job(tl: Timeline, rows: dict, traced_ns: int, tails: RunqTails | None, base_step: float) -> _Job:
    m = tl.m
    med = median_of_others(tl.key, m.w.astype(np.float64))
    med = np.where(np.isnan(med) | (tl.key < 0), m.w, med)
    own = own_per_rank(tl, m.w)
    role = {r: tl.stage_of.get(r, 0) for r in own}
    work, work_step = m.w, base_step
    if tails is not None and len(tails.rank):
        work = np.maximum(m.w - runq_in_events(tl, tails, once=True), 0).astype(np.int64)
        work_step = tl.step_ns(replay(tl.ev, work, m.x).e)
    own_z: dict = {}
    for s in set(role.values()):
        own_z.update(robust_z({r: v for r, v in own.items() if role[r] == s}, max(0.01 * base_step, 100_000)))
    return _Job(tl, rows, traced_ns, base_step, fixed_w=np.minimum(m.w, med).astype(np.int64),
                slot=np.where(tl.key >= 0, tl.role * tl.slots + tl.since, -1), own=own,
                peers_own=_role_peers(own, role), own_z=own_z,
                own_rq=runq_in_own_work(tl, tails) if tails is not None else None, work=work,
                work_step=work_step, replayer=_Replayer(tl, base_step))


def _role_peers(own: dict, role: dict) -> dict:
    """Rank -> the median of the other ranks' `own` of its role (its own value when it is alone)."""
    by_role: dict = {}
    for r in own:
        by_role.setdefault(role[r], []).append(r)
    out: dict = {}
    for ranks in by_role.values():
        out.update(zip(ranks, _medians_of_others(np.array([own[r] for r in ranks], np.float64)).tolist()))
    return {r: out[r] for r in own}


def _medians_of_others(v: np.ndarray) -> np.ndarray:
    """Per value, ``_peer_median`` of the others (itself when it is alone), in one sort."""
    m = len(v)
    if m == 1 or np.isnan(v).any():
        return np.array([_peer_median(dict(enumerate(v.tolist())), i, v[i]) for i in range(m)])
    o = np.argsort(v, kind="stable")
    s, at = v[o], np.empty(m, np.int64)
    at[o] = np.arange(m)
    h = (m - 1) // 2
    nth = lambda j: s[j + (j >= at)]        # noqa: E731  the j-th smallest of the others
    return nth(h) if (m - 1) % 2 else (nth(h - 1) + nth(h)) / 2


def _peer_median(vals: dict, r, alone: float = float("nan")) -> float:
    """The median of the values of every key but `r` (`alone` when there are none)."""
    others = [v for k, v in vals.items() if k != r]
    return float(np.median(others)) if others else alone


def _offcpu_floor_ms(traced_ns: int) -> float:
    """The scale of an off-CPU outlier when the peers agree closely: OFFCPU_FLOOR_MS, or
    OFFCPU_FLOOR_TRACED of the traced time when that is more."""
    return max(OFFCPU_FLOOR_MS, OFFCPU_FLOOR_TRACED * traced_ns / 1e6)


def _dep_sources(ev) -> np.ndarray:
    """For each entry of the dependency lists (`ev.dep_idx`), the event it belongs to."""
    return np.repeat(np.arange(len(ev.a)), np.diff(ev.dep_ptr))


def _rank_candidates(j: _Job) -> list[Candidate]:
    """The ranks with the largest excess own work, each with its own work set to its peers'."""
    ev, out, excess = j.tl.ev, [], j.excess
    for r in sorted(excess, key=lambda k: -excess[k])[:CANDIDATE_RANKS]:
        if excess[r] <= 0:
            break
        cause, why = _offcpu_cause(j.rows, r, excess[r] * j.tl.steps, j.traced_ns,
                                   _own_runq(j.own_rq, j.own, r, excess[r], j.tl.steps))
        s = j.replayer.saving(np.where(ev.rank == r, j.fixed_w, j.tl.m.w))
        out.append(Candidate("rank", [r], s.ns, f"rank {r}", cause=cause, why=why, score=round(j.own_z.get(r, 0.0), 2),
                             whatif=s.whatif, own=j.own_work(r)))
    return out


def _starved_candidate(j: _Job) -> Candidate | None:
    """A rank starved of CPU: each time it wakes it waits long for a CPU, inside its calls too."""
    st = _starved_rank(j.rows, j.tl, j.traced_ns)
    if st is None:
        return None
    w = np.where(j.tl.ev.rank == st.rank, j.fixed_w, j.tl.m.w)
    s = j.replayer.saving(w, _starved_x(j.tl, st.rank, st.lost))
    return Candidate("rank", [st.rank], s.ns, f"rank {st.rank}", cause="cpu-contention", why=st.why,
                     score=round(st.per_wait, 2), whatif=s.whatif, own=j.own_work(st.rank))


def _stage_candidate(j: _Job) -> Candidate | None:
    """The slowest pipeline stage as a whole, its ranks' own work scaled to the other stages'."""
    tl, ev, m = j.tl, j.tl.ev, j.tl.m
    if len(set(tl.stage_of.values())) <= 1:
        return None
    st_med = _stage_medians(tl.stage_of, j.own)
    # stages of several ranks are compared on their own work with the runqueue wait inside it
    # taken at the job's pooled rate (wait per ns of the rest of the work): a busy machine
    # starves some slots of some stages (a clean 3D job at load 45: stage 0 +12.9 ms/step of
    # own work, +17.5 of runqueue wait in it), which no fix of the stage removes, while a stage
    # that only works longer waits longer in proportion (a 1.5x stage at load 25: 61-74 ms/step
    # of runqueue wait on one node, 20-65 on the other)
    several = len(tl.stage_of) > len(st_med)
    rq = j.own_rq if several and j.own_rq else {}
    rate = _runq_rate(rq, j.own) or 0.0
    net = _stage_medians(tl.stage_of, {r: max(v - rq.get(r, 0.0), 0.0) * (1.0 + rate) for r, v in j.own.items()})
    s = max(net, key=net.__getitem__)
    others = _peer_median(st_med, s)
    keep = _peer_median(net, s) / net[s] if net[s] > 0 else 1.0
    excess = st_med[s] * (1.0 - keep)
    if not (excess > 0 and others > 0):
        return None
    members = sorted(r for r, k in tl.stage_of.items() if k == s)
    inst = np.isin(ev.rank, members) & tl.inwin
    saved = j.replayer.saving(np.where(inst, (m.w * keep).astype(np.int64), m.w))
    score = round(st_med[s] / others, 2)
    if len(members) == 1:              # a stage of one rank (pure pipeline) is that rank
        r, excess = members[0], st_med[s] - others
        cause, why = _offcpu_cause(j.rows, r, excess * tl.steps, j.traced_ns, _own_runq(j.own_rq, j.own, r, excess, tl.steps))
        return Candidate("rank", members, saved.ns, f"rank {r}", cause=cause, why=why, score=score,
                         whatif=saved.whatif, own=OwnWork(st_med[s], others))
    why = (f"its ranks' own work is {st_med[s] / 1e6:.1f} ms/step vs "
           f"{others / 1e6:.1f} ms for the other stages' median")
    if rq:
        why += f" ({excess / 1e6:.1f} ms/step more with each rank's runqueue wait taken at the job's rate)"
    return Candidate("stage", members, saved.ns, f"stage {s} ({_span(members)})", score=score,
                     whatif=saved.whatif, why=why)


def _stage_medians(stage_of: dict, per_rank: dict) -> dict:
    """stage -> the median of its ranks' values."""
    by_stage: dict = {}
    for r, v in per_rank.items():
        if r in stage_of:
            by_stage.setdefault(stage_of[r], []).append(v)
    return {s: float(np.median(v)) for s, v in by_stage.items()}


def _node_candidates(j: _Job) -> list[Candidate]:
    """Nodes whose every rank works more than the ranks of the same role elsewhere (or, for a
    role the node holds whole, than the ranks of other roles): slow machines."""
    ev, m, out = j.tl.ev, j.tl.m, []
    for slow in _slow_nodes(j.rows, j.own, j.tl.stage_of)[:CANDIDATE_NODES]:
        f = np.ones(int(ev.ranks.max()) + 1 if len(ev.ranks) else 1)
        for r, q in slow.ratio.items():
            f[r] = 1.0 / q
        inst = np.isin(ev.rank, slow.ranks) & j.tl.inwin
        s = j.replayer.saving(np.where(inst, (m.w * f[ev.rank]).astype(np.int64), m.w))
        least = min(slow.ratio.values())
        out.append(Candidate("node", slow.ranks, s.ns, f"node {slow.node}", whatif=s.whatif, score=round(least, 2),
                             why=f"every one of its ranks works {least:.2f}x or more what the same role does "
                                 "elsewhere"))
    return out


def _network_candidates(j: _Job, retx: Retransmits, rdma: list | None, proxy: ProxySends | None) -> list[Candidate]:
    """A node's link (TCP retransmits, RDMA loss counters, NCCL's proxy waits) losing data
    while transfers were in flight: those transfers set to the clean median at their position."""
    tl, m, out = j.tl, j.tl.m, []
    for net in (_network(tl, j.rows, retx), _rdma_network(tl, j.rows, rdma), proxy_network(tl, j.rows, proxy)):
        if net is None:
            continue
        hit, clean = net.hit, ~net.hit & tl.inwin
        fallback = float(np.median(m.x[clean])) if clean.any() else 0.0
        target = quantile_at(tl.key[clean], m.x[clean].astype(np.float64), 0.5, tl.key[hit])
        x = m.x.copy()
        x[hit] = np.minimum(m.x[hit], np.where(np.isnan(target), fallback, target).astype(np.int64))
        label = f"rank {net.rank} on {net.node}" if net.single else f"node {net.node}"
        members = [net.rank] if net.single else sorted(r for r, v in j.rows.items() if v.node == net.node)
        s = j.replayer.saving(x=x)
        out.append(Candidate("network", members, s.ns, label, cause="network",
                             why=net.why + transport_note(proxy, members), score=net.share,
                             whatif=s.whatif, net=net))
    return out


def _spread_candidate(j: _Job) -> Candidate:
    """"Fix everyone": each event's own work at most its slot's median (the same ordinal after
    the step marker, over every rank of its stage and every step), itself included: a stage
    slow on one step and fast on the next is imbalance too, which the peers of one step
    cannot show; and the median of the *others* would set a pair of peers both to the
    smaller one. Judged against its own floor, not the best single fix."""
    m, ok = j.tl.m, j.slot >= 0
    cap = quantile_at(j.slot[ok], m.w[ok].astype(np.float64), 0.5, j.slot)
    all_w = np.where(np.isnan(cap), m.w, np.minimum(m.w, cap)).astype(np.int64)
    s = j.replayer.saving(all_w, need=SPREAD_FLOOR_PCT / 100 * j.work_step, alone=True)
    return Candidate("spread", sorted(j.own), s.ns, "spread: no single rank", cause="imbalance", whatif=s.whatif)


def _arbitrate(j: _Job, cands: list[Candidate], retx: Retransmits, local_retx: int) -> Candidate | None:
    """The best single fix among `cands` (the largest saving first), weighed: a starved rank
    against the network fix, a rank against its group, and what the loss says about a rank."""
    if not cands:
        return None
    best = cands[0]
    ranks = [k for k in cands if k.kind == "rank"]
    netc = next((k for k in cands if k.kind == "network"), None)
    if best.kind == "network":
        best = _against_network(j, best, ranks)
    if best.kind == "rank" and netc is not None:
        best.notes.append(f"weighed against {netc.label}'s retransmits (fixing the transfers they slow "
                          f"would save {netc.saving_ns / 1e6:.1f} ms/step), which a rank answering late "
                          "causes without any loss")
    elif best.kind == "rank" and len(retx.ts):
        others = int(np.count_nonzero(retx.rank != best.ranks[0]))
        if others:
            best.notes.append(f"weighed against {others} retransmits on other ranks' connections, "
                              "too few or too spread out to be a lossy link")
    elif best.kind in ("stage", "node") and ranks and ranks[0].saving_ns >= TIE_SHARE * best.saving_ns:
        best = ranks[0]
    if best.kind == "rank" and local_retx:
        best.notes.append(f"{local_retx} retransmits on connections inside one node were not counted as "
                          "link loss (no wire: a receiver that does not drain its socket causes them)")
    return best


def _against_network(j: _Job, net: Candidate, ranks: list[Candidate]) -> Candidate:
    """A starved rank makes its peers retransmit: a rank whose own off-CPU wait explains its
    excess and whose fix saves STARVED_SHARE of the network fix is the cause. A sender on a
    lossy link is woken to retransmit and waits more for a CPU, in its own work too: against
    the network only a rank starved at each wait counts (`_own_offcpu`)."""
    starved = [k for k in ranks if k.cause in OFFCPU_CAUSES and k.saving_ns >= STARVED_SHARE * net.saving_ns
               and _own_offcpu(j.rows, k)]
    if starved:
        return starved[0]
    return _starved_behind(net, j.rows, j.tl, j.traced_ns, j.own, j.peers_own) or net


def _named(j: _Job, best: Candidate | None, spread: Candidate) -> Candidate | None:
    """The candidate named: "spread" where it wins, else the best single fix over the floor.
    A rank whose own off-CPU time (I/O wait, or a CPU it waits for each time it wakes)
    explains its excess is named even where fixing everyone would save more: the kernel
    shows its cause, the rest is spread over the ranks (a busy machine's jitter)."""
    est = _spread_estimate(j, spread, best)
    if est is not None and best is not None and best.kind == "rank" and _own_offcpu(j.rows, best) \
            and j.pct(best) >= SAVING_FLOOR_PCT:
        best.notes.append(f"the rest is spread over the ranks: fixing every rank's excess own work would "
                          f"save {spread.saving_ns / 1e6:.1f} ms/step, this rank "
                          f"{best.saving_ns / spread.saving_ns:.0%} of that")
        return best
    if est is not None:
        share = (best.saving_ns / spread.saving_ns) if best else 0.0
        spread.why = (f"fixing every rank's excess own work would save {spread.saving_ns / 1e6:.1f} ms/step "
                      f"({est.persistent / 1e6:.1f} from ranks working longer for a whole step{est.net}, "
                      f"jitter would give {est.jitter / 1e6:.1f}); the best single fix "
                      f"({best.label if best else 'none'}) only {share:.0%} of that")
        spread.score = round(share, 2)
        excess = j.excess
        spread.worst = max(excess, key=excess.__getitem__)
        return spread
    if best is None or j.pct(best) < SAVING_FLOOR_PCT:
        return None
    return best


def _spread_beats(spread: Candidate, best: Candidate | None, base_step: float) -> bool:
    """Fixing everyone saves SPREAD_FLOOR_PCT of the step, and the best single fix under
    SPREAD_SHARE of that."""
    return spread.saving_ns > 0 and 100.0 * spread.saving_ns / base_step >= SPREAD_FLOOR_PCT and (
        best is None or best.saving_ns < SPREAD_SHARE * spread.saving_ns)


class Persistent(NamedTuple):
    """What fixing imbalance proper saves per step, and what the same estimate gives on the
    job's jitter alone, ns."""

    persistent: float
    jitter: float
    step: float               # the step replayed with the work they are measured on
    net: str = ""             # what that work was taken net of, as the evidence says it


def _spread_estimate(j: _Job, spread: Candidate, best: Candidate | None) -> Persistent | None:
    """The imbalance proper behind "spread", where spread wins: it saves SPREAD_FLOOR_PCT, the
    best single fix under SPREAD_SHARE of it, and ranks working longer for whole steps
    (`_persistent`) account for SAVING_FLOOR_PCT more than the job's jitter would. Capping
    each sync event also removes its jitter, which adds up with the sync events per step.
    Its floors are shares of the step the ranks' own work less the runqueue wait inside it
    replays to (`_Job.work`, where the sched probe gave the waits), and the imbalance proper
    and its jitter are measured on that work: a busy machine makes a rank wait for a CPU
    after most wake-ups (27-47% of the lab's 3D own work at a load of ~45 on two cores),
    which no fix of the ranks removes and which, scattered over their sync events, reads as
    jitter large enough to hide a planted per-step imbalance (1.8% to just under 5% of the
    measured step left over the jitter; net of the waits 7.1-10.2%, a clean job's
    -0.2-0.3%), while the waits lengthen the measured step (the same imbalance's "fix
    everyone" from 12.3-15.0% of the step at load 0 down to 11.7%)."""
    if not _spread_beats(spread, best, j.work_step):
        return None
    est = _persistent(j.tl, j.slot, j.work)
    if j.work is not j.tl.m.w:
        est = est._replace(net=", less their waits for a CPU")
    return est if est.persistent - est.jitter >= SAVING_FLOOR_PCT / 100 * est.step else None


def _persistent(tl: Timeline, slot: np.ndarray, w: np.ndarray) -> Persistent:
    """What fixing imbalance proper saves, and what the same estimate gives on the job's
    jitter alone, ns per step, replayed with own work `w`. Imbalance proper: each rank's work
    in each step, as a ratio to its role's (each sync event's `slot` median over the role's
    ranks and steps), scaled down to that step's median ratio over all ranks where it is
    more: a rank or a stage slower in a step than the job is in that step, not a step the
    whole job (the machine) was slow in. Its jitter: with n sync events per rank and step,
    scaling by a step's ratio leaves 1/sqrt(n) of the per-event jitter, which is what "fix
    everyone" (each event capped at its slot's median) removes from the work with each
    rank-step's ratio divided out."""
    ev, m = tl.ev, tl.m
    step = lambda v: tl.step_ns(replay(ev, v, m.x).e)
    ok = tl.key >= 0
    cap = quantile_at(slot[ok], w[ok].astype(np.float64), 0.5, slot)
    ok &= ~np.isnan(cap)
    if not ok.any():
        return Persistent(0.0, 0.0, step(w))
    seg = np.repeat(np.arange(len(ev.ranks)), np.diff(ev.off))
    B = int(tl.key.max()) // tl.slots + 1
    u, inv, n = np.unique(seg[ok] * B + tl.key[ok] // tl.slots, return_inverse=True, return_counts=True)
    f = np.bincount(inv, weights=w[ok].astype(np.float64)) / np.maximum(np.bincount(inv, weights=cap[ok]), 1.0)
    step_no = (u % B) % (tl.steps + 1)             # the key holds (role * (steps + 1) + step)
    level_of = quantile_at(step_no, f, 0.5, step_no)
    ratio = (f / np.maximum(level_of, 1e-3))[inv]
    fixed, level = w.copy(), w.copy()
    fixed[ok] = (w[ok] / np.maximum(ratio, 1.0)).astype(np.int64)
    level[ok] = (w[ok] / np.maximum(ratio, 1e-3)).astype(np.int64)
    cap = quantile_at(slot[ok], level[ok].astype(np.float64), 0.5, slot)
    capped = np.where(np.isnan(cap), level, np.minimum(level, cap)).astype(np.int64)
    jitter = (step(level) - step(capped)) / np.sqrt(float(np.mean(n)))
    base = step(w)
    return Persistent(base - step(fixed), jitter, base)


class SlowNode(NamedTuple):
    node: str
    ranks: list
    ratio: dict               # rank -> own work / its reference


def _slow_nodes(rows: dict, own: dict, stage_of: dict) -> list[SlowNode]:
    """The nodes of several ranks that all work
    at least NODE_SLOW x their reference (the median of the same role's ranks on other nodes;
    for a role the node holds whole, of the other nodes' ranks), alike (NODE_ALIKE), slowest
    first."""
    node_of = {r: rows[r].node for r in own if r in rows and rows[r].node is not None}
    ranks = np.array(sorted(node_of), np.int64)
    if len(ranks) < 3:
        return []
    vals = np.array([own[r] for r in ranks.tolist()])
    nodes = np.array([node_of[r] for r in ranks.tolist()], object)
    roles = np.array([stage_of.get(r, 0) for r in ranks.tolist()])
    out = []
    for node in sorted(set(nodes.tolist())):
        mine = nodes == node
        if mine.sum() < 2 or mine.all():
            continue
        ratio = {}
        for role in np.unique(roles[mine]).tolist():
            ref = vals[~mine & (roles == role)]
            if not len(ref):
                ref = vals[~mine]
            ref_v = float(np.median(ref))
            for r, v in zip(ranks[mine & (roles == role)].tolist(), vals[mine & (roles == role)].tolist()):
                ratio[r] = v / ref_v if ref_v > 0 else 0.0
        lo, hi = min(ratio.values()), max(ratio.values())
        if lo >= NODE_SLOW and lo - 1 >= NODE_ALIKE * (hi - 1):
            out.append(SlowNode(node, sorted(ratio), ratio))
    return sorted(out, key=lambda t: -min(t.ratio.values()))


def _span(members: list) -> str:
    if len(members) > 1 and members == list(range(members[0], members[-1] + 1)):
        return f"ranks {members[0]}-{members[-1]}"
    return "ranks " + ", ".join(map(str, members[:16])) + (", …" if len(members) > 16 else "")


def runq_in_events(tl: Timeline, tails: RunqTails, once: bool = False) -> np.ndarray:
    """Per event: the runqueue wait (ns) inside its own work, [arrival - own work, arrival],
    for the sync events in the step window (0 elsewhere).

    `tails`: the runnable tail of each recorded off-CPU interval (the wait for a CPU after a
    wake-up, or the whole interval of a preempted thread): the events over the tracer's
    threshold (1 ms by default), of every thread of the rank's process, each counted, or
    (`once`) where the threads' tails overlap, that time once: the time the rank waited."""
    ev, m = tl.ev, tl.m
    rk, ts, te = tails
    out = np.zeros(len(ev.a), np.int64)
    ranks = ev.ranks.astype(np.int64)
    sel = np.flatnonzero(tl.inwin & (m.w > 0))
    mine = np.isin(rk, ranks)
    if not len(sel) or not mine.any():
        return out
    # the wait inside a window is F(end) - F(start), F(t) = the tail time before t: the sum of
    # (t - start) over the rank's tails starting before t less (t - end) over those ending
    # before it. One time line for all ranks, rank after rank (`span` apart), times on it
    # relative to the rank's offset, so that no product leaves int64.
    we = ev.a[sel].astype(np.int64)
    ws = we - m.w[sel]
    t0 = min(int(ws.min()), int(ts[mine].min()))
    span = max(int(we.max()), int(te[mine].max())) - t0 + 1
    if span * (len(ranks) + 1) >= np.iinfo(np.int64).max // 2:
        return out                                   # not on one int64 line: no figure
    tail_off = np.searchsorted(ranks, rk[mine]) * span
    ev_off = np.searchsorted(ranks, ev.rank[sel]) * span
    ts, te = ts[mine] - t0, te[mine] - t0
    if once:                     # each tail from where the ones before it (on its rank's line) end
        o = np.argsort(ts + tail_off, kind="stable")
        tail_off, ts, end = tail_off[o], ts[o], np.maximum.accumulate(te[o] + tail_off[o])
        ts = np.maximum(ts + tail_off, np.r_[ts[:1] + tail_off[:1], end[:-1]]) - tail_off
        te = end - tail_off
    lines = []
    for t in (ts, te):
        o = np.argsort(t + tail_off, kind="stable")
        lines.append(((t + tail_off)[o], np.r_[0, np.cumsum(t[o])]))

    def before(t):
        tot = np.zeros(len(t), np.int64)
        for sign, (at, cum) in zip((1, -1), lines):
            i, i0 = np.searchsorted(at, t + ev_off, side="right"), np.searchsorted(at, ev_off)
            tot += sign * ((i - i0) * t - (cum[i] - cum[i0]))
        return tot

    out[sel] = before(we - t0) - before(ws - t0)
    return out


def runq_in_own_work(tl: Timeline, tails: RunqTails) -> dict:
    """Per rank: the runqueue wait (ns per step) inside its own work in the step window
    (`runq_in_events`)."""
    ranks = tl.ev.ranks.astype(np.int64)
    per_event = runq_in_events(tl, tails).astype(np.float64)
    tot = np.bincount(np.searchsorted(ranks, tl.ev.rank), weights=per_event, minlength=len(ranks))
    return {int(r): float(t) / tl.steps if tl.steps > 0 else 0.0 for r, t in zip(ranks.tolist(), tot.tolist())}


class OwnRunq(NamedTuple):
    """A rank's runqueue wait inside its own work against what its work would wait at its
    peers' rate, ns per step, and the difference as a share of its excess own work."""

    mine: float
    peers: float
    share: float
    steps: int


def _own_runq(own_rq: dict | None, own: dict, r: int, excess_step_ns: float, steps: int) -> OwnRunq | None:
    """None: no runqueue tails, no excess.

    The peers' rate is their runqueue wait per ns of the rest of their own work, pooled: on a
    busy machine a rank that only works longer waits for a CPU in proportion (a slow rank
    beside load 30: 104 ms/step of its 120 against 51-80 of its peers' 65-79), a starved one
    waits more per ns of work than its peers."""
    if not own_rq or r not in own_rq or len(own_rq) < 2 or excess_step_ns <= 0 or steps <= 0:
        return None
    rate = _runq_rate(own_rq, own, but=r)
    expected = own_rq[r] if rate is None else min(own_rq[r], rate * max(own.get(r, 0.0) - own_rq[r], 0.0))
    return OwnRunq(own_rq[r], expected, (own_rq[r] - expected) / excess_step_ns, steps)


def _runq_rate(own_rq: dict, own: dict, but: int | None = None) -> float | None:
    """The ranks' runqueue wait per ns of the rest of their own work (own work less that
    wait), pooled over the ranks of `own_rq` but `but`; None: no such work."""
    ks = [k for k in own_rq if k != but]
    worked = sum(max(own.get(k, 0.0) - own_rq[k], 0.0) for k in ks)
    return sum(own_rq[k] for k in ks) / worked if worked > 0 else None


class _Wait(NamedTuple):
    """One off-CPU reason weighed as the cause of a rank's excess own work."""

    reason: str               # io | runqueue
    cause: str                # io | cpu-contention
    share: float              # of the excess own work it covers
    alone: bool               # it names the cause by itself
    ratio: float              # the rank's time over its peers' median
    said: str                 # the figures
    detail: str = ""          # the outlier test's figures, said for the cause named


def _offcpu_cause(rows: dict, r: int, excess_total_ns: float, traced_ns: int,
                  own: OwnRunq | None = None) -> tuple[str, str]:
    """cpu-contention or io when the rank's off-CPU time of that reason is an outlier among
    the ranks and lines up with its excess own work, with the evidence.

    Each reason whose time is an outlier on absolute floors and covers OFFCPU_EXPLAINS_WEAK
    of the excess is weighed (`_weigh`); the cause is the one that is the larger multiple of
    its peers' median (on a saturated machine a rank stalled on I/O also waits longer in the
    runqueue, by a factor of its peers' wait, while its I/O wait is its own). It is named
    when it passes alone, or when the weighed waits together cover OFFCPU_EXPLAINS_RUNQUEUE
    of the excess."""
    if r not in rows:
        return "compute/unknown", ""
    found = [w for w in (_weigh(rows, r, reason, excess_total_ns, traced_ns, own) for reason in ("io", "runqueue"))
             if w is not None]
    none = "compute/unknown", "no CPU or I/O wait of its own explains it (off-CPU times weighed)"
    if not found:
        return none
    f = max(found, key=lambda w: w.ratio)
    if not (f.alone or sum(w.share for w in found) >= OFFCPU_EXPLAINS_RUNQUEUE):
        return none
    why = "it spent " + f.said + f.detail
    other = next((w for w in found if w is not f), None)
    if other:
        why += f"; also {other.said} ({other.ratio:.1f}x its peers', against {f.ratio:.1f}x for {f.reason})"
    return f.cause, why


def _weigh(rows: dict, r: int, reason: str, excess_total_ns: float, traced_ns: int,
           own: OwnRunq | None) -> _Wait | None:
    """The rank's `reason` wait as a cause of its excess own work, when it is one to weigh.

    An outlier on the absolute floors covering OFFCPU_EXPLAINS_WEAK; alone when it is also an
    outlier on a scale with a share of the excess as floor (a 6 ms/step fsync on a 50 ms step
    is plenty) and covers OFFCPU_EXPLAINS (OFFCPU_EXPLAINS_RUNQUEUE for the runqueue). Runqueue
    wait counts that way only when its wait per off-CPU interval is STARVED_PER_WAIT times its
    peers' (when the kernel's totals give the number of intervals). Below that it counts,
    alone, when `own` (its runqueue wait inside its own work) exceeds its peers' by
    OFFCPU_EXPLAINS_RUNQUEUE of its excess own work and by the absolute floor over the
    session: where it waited says what its excess is, which a handful of ranks' totals (an
    outlier test on 3 peers) cannot."""
    cause = "cpu-contention" if reason == "runqueue" else reason
    base = _offcpu_floor_ms(traced_ns)
    vals = {k: x.offcpu_ms.get(reason, 0.0) for k, x in rows.items()}
    peers = _peer_median(vals, r)
    share = (vals[r] - peers) * 1e6 / max(excess_total_ns, 1)
    ratio = vals[r] / max(peers, OFFCPU_FLOOR_MS)
    per_wait = _per_wait_ratio(rows, r, reason) if reason == "runqueue" else None
    if per_wait is not None and per_wait < STARVED_PER_WAIT:
        # more waits, not longer ones: woken more often, or starved where it works
        if own is None or own.share < OFFCPU_EXPLAINS_RUNQUEUE or (own.mine - own.peers) * own.steps < base * 1e6:
            return None
        return _Wait(reason, cause, own.share, True, ratio,
                     f"{own.mine / 1e6:.1f} ms/step waiting for a CPU inside its own work vs "
                     f"{own.peers / 1e6:.1f} ms at its peers' rate, {own.share:.0%} of its excess own work ({vals[r]:.0f} ms of "
                     f"runqueue wait in all vs {peers:.0f} ms, {per_wait:.1f}x its peers' per off-CPU interval)")
    if robust_z(vals, base)[r] < OFFCPU_Z or share < OFFCPU_EXPLAINS_WEAK:
        return None
    need = OFFCPU_EXPLAINS_RUNQUEUE if reason == "runqueue" else OFFCPU_EXPLAINS
    z = robust_z(vals, max(base, OFFCPU_FLOOR_SHARE * excess_total_ns / 1e6))[r]
    return _Wait(reason, cause, share, z >= OFFCPU_Z and share >= need, ratio,
                 f"{vals[r]:.0f} ms off-CPU in {reason} wait vs a peer median of {peers:.0f} ms",
                 f" (z {z:.1f}), {share:.0%} of its excess own work")


def _own_offcpu(rows: dict, k: Candidate) -> bool:
    """Is the rank candidate's cause an off-CPU wait of its own by the kernel's totals, strong
    enough to outweigh a network or a spread verdict: io, or cpu-contention with each wait
    STARVED_PER_WAIT times its peers' (or no interval counts to judge by). A rank named
    cpu-contention only by where it waited (its own work) does not: a lossy link's sender
    and a busy machine's imbalance put runqueue wait there too."""
    if k.kind != "rank" or k.cause not in OFFCPU_CAUSES:
        return False
    if k.cause == "io":
        return True
    per_wait = _per_wait_ratio(rows, k.ranks[0])
    return per_wait is None or per_wait >= STARVED_PER_WAIT


def _per_wait_ratio(rows: dict, r: int, reason: str = "runqueue") -> float | None:
    """The rank's `reason` time per off-CPU interval (every interval ends with a wait for a CPU)
    over its peers' median (None: interval counts unknown)."""
    per = {k: x.offcpu_ms.get(reason, 0.0) / sum(x.offcpu_waits.values())
           for k, x in rows.items() if sum(x.offcpu_waits.values()) > 0}
    if r not in per or len(per) < 2:
        return None
    peers = _peer_median(per, r)
    return per[r] / peers if peers > 0 else None


class Starved(NamedTuple):
    rank: int
    lost: float               # the share of its transfers' time lost to its starvation
    per_wait: float           # its runqueue wait per off-CPU interval over its peers'
    why: str


def _starved_rank(rows: dict, tl: Timeline, traced_ns: int) -> Starved | None:
    """The rank starved of CPU, if one is.

    Starved: its runqueue wait is an outlier (the floors of `_offcpu_cause`) and each wait
    is STARVED_PER_WAIT times its peers'. Its extra runqueue wait per step beyond what its
    excess own work holds was spent inside its calls, where the other members of its
    collectives and the receivers of its sends wait for it: its what-if takes that share
    `f` out of the transfers it takes part in (`_starved_x`). The kernel gives the wait per
    process, not per call, so it is spread over the transfers in proportion to their length."""
    vals = {k: x.offcpu_ms.get("runqueue", 0.0) for k, x in rows.items()}
    if len(vals) < 3 or tl.steps <= 0:
        return None
    z = robust_z(vals, _offcpu_floor_ms(traced_ns))
    r = max(vals, key=vals.__getitem__)
    per_wait = _per_wait_ratio(rows, r)
    if z[r] < OFFCPU_Z or per_wait is None or per_wait < STARVED_PER_WAIT:
        return None
    ev, m = tl.ev, tl.m
    peers = _peer_median(vals, r)
    extra = (vals[r] - peers) * 1e6 / tl.steps                  # ns per step
    mine = (ev.rank == r) & tl.inwin
    own_extra = max(float(m.w[mine].sum()) / tl.steps - float(np.median(
        [m.w[(ev.rank == k) & tl.inwin].sum() / tl.steps for k in vals if k != r])), 0.0)
    xfer = float(m.x[mine].sum()) / tl.steps
    if xfer <= 0:
        return None
    f = min(max(extra - own_extra, 0.0) / xfer, 0.9)
    why = (f"it spent {vals[r]:.0f} ms waiting in the runqueue vs a peer median of {peers:.0f} ms (z "
           f"{z[r]:.1f}), {extra / 1e6:.1f} ms/step more, {per_wait:.1f}x its peers' wait each time it came "
           f"back from off-CPU; {f:.0%} of its transfers' time is taken as lost to it")
    return Starved(r, f, per_wait, why)


def _starved_x(tl: Timeline, r: int, f: float) -> np.ndarray:
    """Transfers with rank `r`'s starvation taken out: every event of a collective instance it
    is in, its own events, and the events that depend on one of its (its sends' receivers),
    shortened by the share `f`."""
    ev, m = tl.ev, tl.m
    sel = ev.rank == r
    has = ev.inst >= 0
    sel |= has & np.isin(ev.inst, np.unique(ev.inst[sel & has]))
    if len(ev.dep_idx):
        sel[_dep_sources(ev)[ev.rank[ev.dep_idx] == r]] = True
    x = m.x.copy()
    sel &= tl.inwin
    x[sel] = (x[sel] * (1.0 - f)).astype(np.int64)
    return x


def _starved_behind(net: Candidate, rows: dict, tl: Timeline, traced_ns: int, own: dict,
                    peers_own: dict) -> Candidate | None:
    """The rank starved of CPU behind a network candidate's retransmits, if the timeline says so.

    A rank that waits in the runqueue answers late: its peers' retransmit timers fire and
    its own sockets' ACKs are handled late, with no segment lost, and the transfers with
    those retransmits in flight are slow. A lossy link leaves its node's ranks on CPU. So
    when a rank of the network candidate's node is an outlier of runqueue wait (the off-CPU
    floors of `_offcpu_cause`) and its extra wait per step is at least STARVED_SHARE of
    what the network fix saves per step (enough to have caused it), and each of its waits is
    STARVED_PER_WAIT times its peers' (starved, not only woken more often: a lossy link's
    retransmit timers wake its sender more, and it then waits more in total), the starved
    rank is the cause, with that saving: fixing its CPU is what makes those transfers fast. Its own work
    need not be longer than its peers': on a synchronous NCCL it is starved inside the
    collectives too (the lab's 2x2 cpu-hog)."""
    vals = {k: x.offcpu_ms.get("runqueue", 0.0) for k, x in rows.items()}
    if net.net is None or net.net.rdma or len(vals) < 3 or tl.steps <= 0:   # RDMA: no TCP timers
        return None
    node = net.net.node
    z = robust_z(vals, _offcpu_floor_ms(traced_ns))
    on_node = [k for k, x in rows.items() if x.node == node]
    if not on_node:
        return None
    r = max(on_node, key=lambda k: vals[k])
    peers = _peer_median(vals, r)
    extra_ns = (vals[r] - peers) * 1e6 / tl.steps
    per_wait = _per_wait_ratio(rows, r)
    if z[r] < OFFCPU_Z or extra_ns < STARVED_SHARE * net.saving_ns or per_wait is None \
            or per_wait < STARVED_PER_WAIT:
        return None
    why = (f"it spent {vals[r]:.0f} ms waiting in the runqueue vs a peer median of {peers:.0f} ms "
           f"(z {z[r]:.1f}), {extra_ns / 1e6:.1f} ms/step more, {per_wait:.1f}x its peers' wait each time "
           f"it came back from off-CPU; the transfers slowed with retransmits in "
           f"flight on {node}'s connections ({net.net.lead}) are what a rank answering late "
           f"causes without any loss: fixing them would save {net.saving_ns / 1e6:.1f} ms/step, and a "
           "lossy link leaves its ranks on CPU")
    return Candidate("rank", [r], net.saving_ns, f"rank {r}", cause="cpu-contention", why=why,
                     score=round(z[r], 2), whatif=net.whatif, own=OwnWork(own.get(r, 0.0), peers_own.get(r, 0.0)))


class _NodeRetx(NamedTuple):
    n: int                    # its retransmits inside some transfer window
    hit: np.ndarray           # the sync events with one of them in their transfer window
    owners: np.ndarray        # the rank owning the connection of each of those n (-1: none)


def _retx_by_node(tl: Timeline, retx: Retransmits) -> dict:
    """Node -> its retransmits that fall inside transfer windows (`_NodeRetx`)."""
    ev, m = tl.ev, tl.m
    # the events with any retransmit in their transfer window (few): each node's are among them
    k = np.searchsorted(retx.ts, ev.e, side="right") - np.searchsorted(retx.ts, m.ready, side="left")
    cand = np.flatnonzero((k > 0) & tl.inwin)
    lo, hi = m.ready[cand], ev.e[cand]
    by_node: dict = {}
    for nd in sorted({n for n in retx.node if n is not None}):
        sel = np.array([n == nd for n in retx.node])
        t = retx.ts[sel]
        hit = (np.searchsorted(t, hi, side="right") - np.searchsorted(t, lo, side="left")) > 0
        inwin = np.zeros(len(t), bool)
        if hit.any():
            order = np.argsort(lo[hit])
            l, h = lo[hit][order], np.maximum.accumulate(hi[hit][order])
            i = np.searchsorted(l, t, side="right") - 1
            inwin = (i >= 0) & (h[np.maximum(i, 0)] >= t)
        by_node[nd] = _NodeRetx(int(inwin.sum()), cand[hit], retx.rank[sel][inwin])
    return by_node


def _network(tl: Timeline, rows: dict, retx: Retransmits) -> NetworkHit | None:
    """The node whose connections retransmit while transfers are in flight, if concentrated
    there (RETX_SHARE), and the rank whose connections hold most of them."""
    if len(retx.ts) < RETX_MIN:
        return None
    ev, m = tl.ev, tl.m
    by_node = _retx_by_node(tl, retx)
    total = sum(v.n for v in by_node.values())
    if total < RETX_MIN:
        return None
    node = max(by_node, key=lambda k: by_node[k].n)
    n, hit_idx, owners = by_node[node]
    hit = np.zeros(len(ev.a), bool)
    hit[hit_idx] = True
    if n < RETX_SHARE * total or hit.sum() < RETX_MIN_EVENT_SHARE * tl.inwin.sum():
        return None
    owners = owners[owners >= 0]
    node_ranks = [r for r, v in rows.items() if v.node == node]
    rank, single, owned = min(node_ranks, default=None), False, None
    if len(owners):
        u, cnt = np.unique(owners, return_counts=True)
        rank, owned = int(u[np.argmax(cnt)]), int(cnt.max())
        single = len(node_ranks) == 1 or cnt.max() >= RETX_SHARE * len(owners)
    loss = Loss(n, total, node, rank, owned)
    clean = m.x[~hit & tl.inwin]
    why = (f"{loss.text()}; transfers with one in flight take {np.median(m.x[hit]) / 1e6:.1f} ms at median vs "
           f"{(np.median(clean) if len(clean) else 0) / 1e6:.1f} ms without, in {int(hit.sum())} of "
           f"{int(tl.inwin.sum())} sync events, with arrivals on time{_proxy_evidence(rows, node)}")
    return NetworkHit(node, hit, why, round(n / total, 2), rank, single, lead=loss.text())


def _proxy_evidence(rows: dict, node) -> str:
    """NCCL's own view of the same link, when the profiler plugin summarised proxy operations:
    how long the node's ranks' sends waited on the network against the other ranks'."""
    mine = [v.net_wait_ms for v in rows.values() if v.node == node and v.net_wait_ms is not None]
    others = [v.net_wait_ms for v in rows.values() if v.node != node and v.net_wait_ms is not None]
    if not mine or not others:
        return ""
    return (f"; NCCL's proxy: {node}'s ranks' sends waited up to {max(mine):.0f} ms on the network, "
            f"the other ranks' {float(np.median(others)):.0f} ms at median")


class _PortHit(NamedTuple):
    k: int                    # counter rises in intervals that overlap a crossing transfer
    port: RdmaPort
    hit: np.ndarray           # per sync event: a crossing transfer that overlaps a rise
    behind: list              # the traced ranks that use the port
    during: np.ndarray        # per interval of the port: it overlaps a crossing transfer


def _rdma_network(tl: Timeline, rows: dict, ports: list | None) -> NetworkHit | None:
    """The RDMA port whose loss or congestion counters rose while transfers that cross it were
    in flight, if concentrated there, and a rank behind it (alone when only it uses the port
    or only it is on the node). A port no traced rank uses is evidence for nobody."""
    if not ports or not len(tl.ev.a):
        return None
    m = tl.m
    nodes = sorted({v.node for v in rows.values() if v.node is not None})
    code = np.full(int(tl.ev.rank.max()) + 1, -1)
    for r, v in rows.items():
        if 0 <= r < len(code) and v.node is not None:
            code[r] = nodes.index(v.node)
    found = [_port_hit(tl, p, [r for r in p.ranks if r in rows], code, nodes.index(p.node))
             for p in ports if p.node in nodes and any(r in rows for r in p.ranks)]
    total = sum(f.k for f in found)
    if total < RETX_MIN:
        return None
    k, p, hit, behind, during = max(found, key=lambda f: f.k)
    assert p.node is not None           # only ports on a traced node were found
    clean = m.x[~hit & tl.inwin]
    if k < RETX_SHARE * total or hit.sum() < RETX_MIN_EVENT_SHARE * tl.inwin.sum() or not len(clean):
        return None
    what = ", ".join(f"{c:,} {w}" for w, c in p.totals(during))
    who = f"rank {behind[0]}" if len(behind) == 1 else _span(behind)
    why = (f"network: {p.label()}: {what} while transfers crossing it were in flight ({who} use it, "
           f"mapped by {p.how}; {int(during.sum())} sampling intervals); transfers with them take "
           f"{np.median(m.x[hit]) / 1e6:.1f} ms at median vs {np.median(clean) / 1e6:.1f} ms without, in "
           f"{int(hit.sum())} of {int(tl.inwin.sum())} sync events")
    node_ranks = [r for r, v in rows.items() if v.node == p.node]
    single = len(behind) == 1 or len(node_ranks) == 1
    return NetworkHit(p.node, hit, why, round(k / total, 2), behind[0] if single else min(node_ranks), single,
                      rdma=True)


def _port_hit(tl: Timeline, p: RdmaPort, behind: list, code: np.ndarray, node: int) -> _PortHit:
    """The transfers crossing port `p` (a rank behind it exchanges with a rank on another
    node: a collective instance or a send/recv pair holding both; `code`: each rank's node
    number) and those that overlap a sampling interval in which its counters rose."""
    ev, m, n = tl.ev, tl.m, len(tl.ev.a)
    has = ev.inst >= 0
    ni = int(ev.inst.max()) + 1 if has.any() else 0
    src = _dep_sources(ev)
    mine = np.isin(ev.rank, behind)
    far = (code[ev.rank] >= 0) & (code[ev.rank] != node)
    cross = np.zeros(n, bool)
    if ni:
        both = (np.bincount(ev.inst[has], mine[has], ni) > 0) & (np.bincount(ev.inst[has], far[has], ni) > 0)
        cross[has] = both[ev.inst[has]]
    pair = (mine[src] & far[ev.dep_idx]) | (far[src] & mine[ev.dep_idx])
    cross[src[pair]] = True
    cross &= tl.inwin
    i = np.searchsorted(p.start, ev.e, side="right") - 1       # the port's intervals are disjoint
    hit = cross & (i >= 0) & (p.end[np.maximum(i, 0)] >= m.ready)
    # its intervals that overlap a crossing transfer: the rises counted as evidence
    lo, hi = m.ready[cross], ev.e[cross]
    o = np.argsort(lo, kind="stable")
    lo, hi = lo[o], np.maximum.accumulate(hi[o])
    j = np.searchsorted(lo, p.end, side="right") - 1
    during = (j >= 0) & (hi[np.maximum(j, 0)] >= p.start) if len(lo) else np.zeros(len(p.start), bool)
    return _PortHit(int(p.count[during].sum()), p, hit, behind, during)


def rdma_notes(ports: list) -> list[str]:
    """One line per RDMA port whose loss or congestion counters rose: what, and whose it is."""
    out = []
    for p in ports:
        who = ((f"rank {p.ranks[0]}" if len(p.ranks) == 1 else _span(p.ranks)) + f", mapped by {p.how}"
               if p.ranks else "no traced rank uses it")
        what = ", ".join(f"{c:,} {w}" for w, c in p.totals())
        out.append(f"RDMA: node {p.node}, {p.label()} ({who}): {what} during the trace")
    return out

def _straggler(k: Candidate, j: _Job, base: Replayed) -> Straggler:
    """The named candidate as the report says it: the worst rank in it, its kind (a stage or
    node of one rank, or one rank's connections, is that rank), and the ranks late because of it."""
    rows, excess = j.rows, j.excess
    if k.kind == "spread":
        who = k.worst
    elif k.net is not None:
        who = k.ranks[0] if k.net.single else max(
            k.ranks, key=lambda r: (rows[r].retransmits_in_window, rows[r].net_wait_ms or 0.0))
    else:
        who = max(k.ranks, key=lambda r: excess.get(r, 0.0))
    row = rows.get(who)
    named = set(k.ranks) if k.kind != "spread" else set()
    kind = "node" if k.kind == "network" else k.kind
    if k.net is not None and k.net.single or kind in ("stage", "node") and len(k.ranks) == 1:
        kind = "rank"
    group = None if kind == "rank" else (f"node {k.net.node}" if k.net is not None else k.label)
    return Straggler(rank=who, node=row.node if row else None, pod=row.pod if row else None,
                     cause=k.cause, score=round(float(k.score), 2), evidence=_evidence(k, j.base_step),
                     saving_ms_per_step=k.saving_ns / 1e6, saving_pct=j.pct(k),
                     group=group, kind=kind, ranks=sorted(k.ranks) if k.kind != "spread" else [],
                     propagated=_propagated(j.tl, named, j.base_step, k.whatif, base) if named else [])


def _evidence(k: Candidate, base_step: float) -> str:
    pred = (base_step - k.saving_ns) / 1e6
    what_if = f"replayed without it the step takes {pred:.1f} ms instead of {base_step / 1e6:.1f} ms"
    why = k.text()
    if k.kind == "rank" and k.own is not None:
        return (f"rank {k.ranks[0]}'s own work (between its blocking calls) is {k.own.own / 1e6:.1f} ms/step vs "
                f"{k.own.peers / 1e6:.1f} ms for its peers' median; {what_if}{'; ' + why if why else ''}")
    if k.kind == "spread":
        return f"{why}; the slowdown is spread over many ranks, not one"
    return f"{why}; {what_if}"


def _propagated(tl: Timeline, named: set, base_step: float, fixed: WhatIf | None, base: Replayed) -> list[str]:
    """Ranks that wait longer only because of the named ones: the wait each rank loses in
    the replay without them, and the dependency it waited on."""
    if fixed is None:
        return []
    rep, x = fixed
    ev, m = tl.ev, tl.m
    wait_base = (base.e - tl.m.x) - base.a
    wait_fixed = (rep.e - x) - rep.a
    gain = np.where(tl.inwin, wait_base - wait_fixed, 0).astype(np.float64)
    W = int(ev.ranks.max()) + 1
    sel = tl.inwin & (m.crit != ev.rank)
    key = ev.rank[sel] * W + m.crit[sel]
    by = np.bincount(key, weights=gain[sel], minlength=W * W).reshape(W, W) / tl.steps
    tot = by.sum(axis=1)
    out: list[str] = []
    for r in np.argsort(-tot).tolist():
        if r in named or tot[r] < 0.02 * base_step or len(out) >= 8:
            continue
        via = int(np.argmax(by[r]))
        ms = tot[r] / 1e6
        if via in named:
            out.append(f"rank {r} is late because it waits on rank {via} ({ms:.1f} ms/step)")
        else:
            src = int(np.argmax(by[via])) if by[via].max() > 0 else None
            tail = f", which waits on rank {src}" if src in named else f", late because of {_names(named)}"
            out.append(f"rank {r} is late because it waits on rank {via}{tail} ({ms:.1f} ms/step)")
    return out


def _names(named: set) -> str:
    n = sorted(named)
    return f"rank {n[0]}" if len(n) == 1 else _span(n)
