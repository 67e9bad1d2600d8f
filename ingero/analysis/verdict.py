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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ingero.analysis.calls import Calls
from ingero.analysis.model import Straggler
from ingero.analysis.proxy import proxy_network, transport_note
from ingero.analysis.replay import replay
from ingero.analysis.stats import median_of_others, quantile_at, robust_z
from ingero.analysis.steps import Timeline, own_per_rank

SAVING_FLOOR_PCT = 5.0        # fixing the named rank (or group) must save >= 5% of the step
SPREAD_FLOOR_PCT = 12.0       # "spread" needs more: a busy machine's jitter alone removes ~5-8%
SPREAD_SHARE = 0.5            # the best single fix removes < half of "fix everyone": spread (unless that
                              # fix is a rank with an off-CPU cause of its own, OFFCPU_CAUSES)
# ... and "fix everyone" must hold imbalance proper: ranks working longer for a whole step
# (`_persistent`), by SAVING_FLOOR_PCT more than that estimate gives on the job's own jitter.
# Capping each sync event also removes its jitter, which adds up with the sync events per step
# (an FSDP step has ~20 per rank): a clean FSDP job on a busy machine read "spread" 14.3-16.9%.
OFFCPU_CAUSES = ("io", "cpu-contention")
TIE_SHARE = 0.9               # a rank within 90% of a group's saving is named instead (more specific)
STARVED_SHARE = 0.5           # an off-CPU-explained rank within 50% of the network fix wins
RETX_MIN = 3                  # fewer retransmits in transfer windows than this is not a cause
RETX_SHARE = 0.67             # a node holding >= 2/3 of them is where the loss is
RETX_MIN_EVENT_SHARE = 0.05   # ... and they hit >= 5% of the sync events
OFFCPU_Z = 3.5                # off-CPU time (of one reason) an outlier among the ranks
OFFCPU_FLOOR_MS = 10.0        # ... by at least this much over the session when the peers agree closely,
OFFCPU_FLOOR_SHARE = 0.1      # ... and 10% of the excess own work it would explain
OFFCPU_FLOOR_TRACED = 0.002   # ... and 0.2% of the traced time
OFFCPU_EXPLAINS = 0.3         # ... covering >= 30% of the rank's excess own work (I/O: its write path is
                              # CPU work of its own; the lab's io-stall: 40-48%)
OFFCPU_EXPLAINS_RUNQUEUE = 0.5  # runqueue wait: at least half of it. A starved rank waits longer than its
                              # excess (lab cpu-hog victims: 225-238%, all threads, in calls too), a
                              # slow rank beside a cpu-hog lab also waits more (GPU-like slow-rank: 14-23%,
                              # once over 30% beside a CI run: named cpu-contention)
OFFCPU_EXPLAINS_WEAK = 0.15   # a second reason, an outlier on the absolute floors, covering >= 15%,
                              # is weighed against the first by its multiple of the peers' median
STARVED_PER_WAIT = 4.0        # cpu-contention: the rank waits >= 4x its peers' median for a CPU each time
                              # it comes back from off-CPU (runqueue time / off-CPU intervals, from the
                              # kernel's totals). A starved rank waits long each time (lab cpu-hog
                              # victims: 7.7-41x, DP, 3D and GPU-like, 2026-11-25); a rank that is only
                              # woken more often or works longer waits more in total, not per interval
                              # (lossy-link senders 0.9-2.3x, io-stall 0.8-1.5x, slow-rank 1.2-1.7x,
                              # clean and imbalance <= 1.7x: 37 kept lab traces)
# ... or, below that, where the wait lies says it: the runqueue tails of the rank's off-CPU
# intervals that fall inside its own work (between its blocking calls, in the step window)
# exceed its peers' median by OFFCPU_EXPLAINS_RUNQUEUE of its excess own work. Its own work
# is longer because it waited for a CPU there, not because it computed longer (slow-rank
# victims: -0.03-0.33 of their excess, io-stall -0.38-0.35; cpu-hog victims 1.0-1.9; mild
# cpu-hog victims, a neighbour weighing 1-2 ranks, 1.0 at 1.5-3.8x per wait; 74 kept lab
# traces and 40 runs beside a cpu-hog lab, 2026-11-26; the clean job's rank a busy machine
# starved in CI, 1.7x per wait, held 2.1x its excess in runqueue wait by the kernel's
# totals). Such a rank is named cpu-contention, but outweighs neither a lossy link nor
# "spread" (`_own_offcpu`): a sender whose segments are lost is woken to retransmit, inside
# its own work too (DP lossy-link victims beside a cpu-hog lab: 1.3-2.4, 1.0-2.0x per wait),
# and on a busy machine the rank with the most excess own work of a clean or imbalanced job
# often holds more runqueue wait there than its small excess (1.0-2.3), so against those
# only the per-wait test counts.
CANDIDATE_RANKS = 3           # ranks with the largest excess own work that are replayed
CANDIDATE_NODES = 2           # slow nodes replayed (the slowest first)
NODE_SLOW = 1.05              # a node is slow when each of its ranks works >= 1.05x its reference
NODE_ALIKE = 0.7              # ... and the least slow has >= 70% of the slowest one's excess


@dataclass
class Candidate:
    kind: str                 # rank | stage | node | network | spread
    ranks: list
    saving_ns: float
    label: str
    cause: str = "compute/unknown"
    why: str = ""
    score: float = 0.0
    extra: dict = field(default_factory=dict)


def decide(c: Calls, tl: Timeline, rows: dict, retx, traced_ns: int,
           tails: tuple | None = None, rdma: list | None = None, proxy=None) -> tuple[Straggler | None, dict]:
    """The verdict and the figures behind it (base and predicted step, best candidate).

    `tails`: the runqueue tails of the ranks' off-CPU intervals, (rank, start, end) arrays
    (`stats.runqueue_tails`); without them only the per-wait test names cpu-contention.
    `rdma`: the RDMA ports whose loss or congestion counters rose (`stats.rdma_ports`).
    `proxy`: the plugin's send ProxyOps (`proxy.proxy_sends`)."""
    ev, m = tl.ev, tl.m
    base = replay(ev, m.w, m.x)
    base_step = tl.step_ns(base.e)
    info = {"base_step_ns": base_step, "stuck_rounds": base.stuck_rounds, "base_replay": base}
    if base_step <= 0:
        return None, info
    med = median_of_others(tl.key, m.w.astype(np.float64))
    med = np.where(np.isnan(med) | (tl.key < 0), m.w, med)
    fixed_w = np.minimum(m.w, med).astype(np.int64)
    # "fix everyone": each event's own work at most its slot's median (the same ordinal
    # after the step marker, over every rank of its stage and every step), itself included:
    # a stage slow on one step and fast on the next is imbalance too, which the peers of
    # one step cannot show; and the median of the *others* would set a pair of peers both
    # to the smaller one
    ok = tl.key >= 0
    slot = np.where(ok, tl.role * tl.slots + tl.since, -1)
    cap = quantile_at(slot[ok], m.w[ok].astype(np.float64), 0.5, slot)
    all_w = np.where(np.isnan(cap), m.w, np.minimum(m.w, cap)).astype(np.int64)

    replays: dict = {}

    best_so_far = [0.0]

    def removed(w=None, x=None) -> float:
        """Work taken out per step: no replay can save more (a path holds each event once)."""
        tot = 0.0
        if w is not None:
            tot += float((m.w - w)[tl.inwin].sum())
        if x is not None:
            tot += float((m.x - x)[tl.inwin].sum())
        return tot / tl.steps

    def saving(w=None, x=None, need: float = 0.0) -> float:
        """The replayed saving; not replayed (0) when it cannot reach `need` or the best so far."""
        if best_so_far[0] > 0 or need > 0:
            if removed(w, x) < max(best_so_far[0], need):
                replays[len(replays)] = None
                return 0.0
        r = replay(ev, m.w if w is None else w, m.x if x is None else x)
        best_so_far[0] = max(best_so_far[0], base_step - tl.step_ns(r.e))
        replays[len(replays)] = (r, m.x if x is None else x)
        return base_step - tl.step_ns(r.e)

    def last_replay() -> dict:
        return {"replay": replays[len(replays) - 1]}     # None: not replayed

    own = own_per_rank(tl, m.w)
    peers_own = {}
    for r, v in own.items():
        role = tl.stage_of.get(r, 0)
        others = [own[k] for k in own if k != r and tl.stage_of.get(k, 0) == role]
        peers_own[r] = float(np.median(others)) if others else v
    excess = {r: own[r] - peers_own[r] for r in own}
    own_rq = runq_in_own_work(tl, tails) if tails is not None else None
    own_z: dict = {}
    for role in set(tl.stage_of.get(r, 0) for r in own):
        grp = {r: v for r, v in own.items() if tl.stage_of.get(r, 0) == role}
        own_z.update(robust_z(grp, max(0.01 * base_step, 100_000)))
    cands: list[Candidate] = []
    # ranks with the largest excess own work
    for r in sorted(excess, key=lambda k: -excess[k])[:CANDIDATE_RANKS]:
        if excess[r] <= 0:
            break
        w = np.where(ev.rank == r, fixed_w, m.w)
        cause, why = _offcpu_cause(rows, r, excess[r] * tl.steps, traced_ns,
                                   _own_runq(own_rq, r, excess[r], tl.steps))
        cands.append(Candidate("rank", [r], saving(w), f"rank {r}", cause=cause, why=why,
                               score=round(own_z.get(r, 0.0), 2),
                               extra={"excess_ms": excess[r] / 1e6, "own_ms": own[r] / 1e6,
                                      "peers_ms": peers_own[r] / 1e6, **last_replay()}))
    # a rank starved of CPU: each time it wakes it waits long for a CPU, inside its calls too
    st = _starved_rank(rows, tl, traced_ns)
    if st is not None:
        r, f, per_wait, why = st
        w = np.where(ev.rank == r, fixed_w, m.w)
        cands.append(Candidate("rank", [r], saving(w, _starved_x(tl, r, f)), f"rank {r}", cause="cpu-contention",
                               why=why, score=round(per_wait, 2),
                               extra={"excess_ms": excess.get(r, 0.0) / 1e6, "own_ms": own.get(r, 0.0) / 1e6,
                                      "peers_ms": peers_own.get(r, 0.0) / 1e6, "starved": f, **last_replay()}))
    # the slowest pipeline stage, as a whole
    if len(set(tl.stage_of.values())) > 1:
        by_stage: dict = {}
        for r, v in own.items():
            if r in tl.stage_of:
                by_stage.setdefault(tl.stage_of[r], []).append(v)
        st_med = {s: float(np.median(v)) for s, v in by_stage.items()}
        s = max(st_med, key=st_med.get)
        others = float(np.median([v for k, v in st_med.items() if k != s]))
        if st_med[s] > others > 0:
            f = others / st_med[s]
            members = sorted(r for r, k in tl.stage_of.items() if k == s)
            inst = np.isin(ev.rank, members) & tl.inwin
            w = np.where(inst, (m.w * f).astype(np.int64), m.w)
            why = (f"its ranks' own work is {st_med[s] / 1e6:.1f} ms/step vs "
                   f"{others / 1e6:.1f} ms for the other stages' median")
            if len(members) == 1:      # a stage of one rank (pure pipeline) is that rank
                r = members[0]
                cause, why2 = _offcpu_cause(rows, r, (st_med[s] - others) * tl.steps, traced_ns,
                                            _own_runq(own_rq, r, st_med[s] - others, tl.steps))
                cands.append(Candidate("rank", members, saving(w), f"rank {r}", cause=cause, why=why2,
                                       score=round(st_med[s] / others, 2),
                                       extra={"own_ms": st_med[s] / 1e6, "peers_ms": others / 1e6,
                                              "excess_ms": (st_med[s] - others) / 1e6, **last_replay()}))
            else:
                cands.append(Candidate("stage", members, saving(w), f"stage {s} ({_span(members)})",
                                       score=round(st_med[s] / others, 2), extra=last_replay(), why=why))
    # a node whose every rank works more than the ranks of the same role elsewhere (or, for
    # a role the node holds whole, than the ranks of other roles): a slow machine
    for node, members, ratio in _slow_nodes(rows, own, tl.stage_of)[:CANDIDATE_NODES]:
        f = np.ones(int(ev.ranks.max()) + 1 if len(ev.ranks) else 1)
        for r, q in ratio.items():
            f[r] = 1.0 / q
        inst = np.isin(ev.rank, members) & tl.inwin
        w = np.where(inst, (m.w * f[ev.rank]).astype(np.int64), m.w)
        cands.append(Candidate("node", members, saving(w), f"node {node}", extra=last_replay(),
                               score=round(min(ratio.values()), 2),
                               why=f"every one of its ranks works {min(ratio.values()):.2f}x or more what the "
                                   "same role does elsewhere"))
    for nic, net in ((False, _network(c, tl, rows, retx)), (True, _rdma_network(tl, rows, rdma)),
                     (False, proxy_network(tl, rows, proxy))):
        if net is None:
            continue
        node, hit, why, score, rank, single = net
        x = m.x.copy()
        clean = m.x[~hit & tl.inwin]
        fallback = float(np.median(clean)) if len(clean) else 0.0
        # a hit event's transfer: the clean median at its position (events without a hit)
        target = quantile_at(tl.key[~hit & tl.inwin], m.x[~hit & tl.inwin].astype(np.float64), 0.5, tl.key[hit])
        target = np.where(np.isnan(target), fallback, target)
        x[hit] = np.minimum(m.x[hit], target.astype(np.int64))
        label = f"rank {rank} on {node}" if single else f"node {node}"
        members = [rank] if single else sorted(r for r, v in rows.items() if v.node == node)
        why += transport_note(proxy, members)
        cands.append(Candidate("network", members, saving(x=x), label, cause="network", why=why,
                               score=score, extra={"node": node, "single": single, "rdma": nic, **last_replay()}))
    best_single = best_so_far[0]
    best_so_far[0] = 0.0          # "fix everyone" is judged against its own floor
    spread = Candidate("spread", sorted(own), saving(all_w, need=SPREAD_FLOOR_PCT / 100 * base_step),
                       "spread: no single rank", cause="imbalance", extra=last_replay())
    del best_single
    info["spread_ns"] = spread.saving_ns
    specific = sorted(cands, key=lambda k: -k.saving_ns)
    info["candidates"] = [(k.label, k.saving_ns) for k in specific] + [(spread.label, spread.saving_ns)]
    if not specific:
        best = None
    else:
        best = specific[0]
        ranks_ = [k for k in specific if k.kind == "rank"]
        # a starved rank makes its peers retransmit: when its off-CPU time explains it and its
        # fix saves a good part of what the network fix would, it is the cause
        netc = next((k for k in specific if k.kind == "network"), None)
        if best.kind == "network":
            # a sender on a lossy link is woken to retransmit and waits more for a CPU, in its
            # own work too: against the network only a rank starved at each wait counts
            starved = [k for k in ranks_ if k.cause in ("cpu-contention", "io")
                       and k.saving_ns >= STARVED_SHARE * best.saving_ns
                       and _own_offcpu(rows, k)]
            if starved:
                best = starved[0]
            else:
                best = _starved_behind(best, rows, tl, traced_ns, own, peers_own) or best
        if best.kind == "rank" and netc is not None:
            best.why += (f"; weighed against {netc.label}'s retransmits (fixing the transfers they slow "
                         f"would save {netc.saving_ns / 1e6:.1f} ms/step), which a rank answering late "
                         "causes without any loss")
        elif best.kind == "rank" and len(retx[0]):
            others = int(np.count_nonzero(retx[1] != best.ranks[0]))
            if others:
                best.why += (f"; weighed against {others} retransmits on other ranks' connections, "
                             "too few or too spread out to be a lossy link")
        elif best.kind in ("stage", "node") and ranks_ and ranks_[0].saving_ns >= TIE_SHARE * best.saving_ns:
            best = ranks_[0]
        if best.kind == "rank" and len(retx) > 3 and retx[3]:
            best.why += (f"; {retx[3]} retransmits on connections inside one node were not counted as "
                         "link loss (no wire: a receiver that does not drain its socket causes them)")
    info["best"] = best
    pct = lambda k: 100.0 * k.saving_ns / base_step
    info["best_saving_pct"] = pct(best) if best else 0.0
    # a rank whose own off-CPU time (I/O wait, or a CPU it waits for each time it wakes) explains
    # its excess is named even where fixing everyone would save more: the kernel shows its cause,
    # the rest is spread over the ranks (a busy machine's jitter: the 3D io-stall victim beside a
    # CI run and a cpu-hog lab saved 48% of "fix everyone", 12.2 of 25.6 ms/step)
    spread_wins = spread.saving_ns > 0 and pct(spread) >= SPREAD_FLOOR_PCT and (
        best is None or best.saving_ns < SPREAD_SHARE * spread.saving_ns)
    if spread_wins:
        info["persistent_ns"], info["jitter_ns"] = _persistent(tl, slot, base_step)
        spread_wins = info["persistent_ns"] - info["jitter_ns"] >= SAVING_FLOOR_PCT / 100 * base_step
    if spread_wins and best is not None and best.kind == "rank" and _own_offcpu(rows, best) \
            and pct(best) >= SAVING_FLOOR_PCT:
        best.why += (f"; the rest is spread over the ranks: fixing every rank's excess own work would "
                     f"save {spread.saving_ns / 1e6:.1f} ms/step, this rank {best.saving_ns / spread.saving_ns:.0%} "
                     "of that")
    elif spread_wins:
        worst = max(excess, key=excess.get)
        share = (best.saving_ns / spread.saving_ns) if best else 0.0
        spread.why = (f"fixing every rank's excess own work would save {spread.saving_ns / 1e6:.1f} ms/step "
                      f"({info['persistent_ns'] / 1e6:.1f} from ranks working longer for a whole step, "
                      f"jitter would give {info['jitter_ns'] / 1e6:.1f}); the best single fix "
                      f"({best.label if best else 'none'}) only {share:.0%} of that")
        spread.score = round(share, 2)
        spread.extra["worst"] = worst
        info["named"] = spread
        return _straggler(spread, tl, rows, base_step, excess, base), info
    if best is None or pct(best) < SAVING_FLOOR_PCT:
        return None, info
    info["named"] = best
    return _straggler(best, tl, rows, base_step, excess, base), info


def _persistent(tl: Timeline, slot: np.ndarray, base_step: float) -> tuple[float, float]:
    """(what fixing imbalance proper saves, what the same estimate gives on the job's jitter
    alone), ns per step, replayed. Imbalance proper: each rank's work in each step, as a
    ratio to its role's (each sync event's `slot` median over the role's ranks and steps),
    scaled down to that step's median ratio over all ranks where it is more: a rank or a
    stage slower in a step than the job is in that step, not a step the whole job (the
    machine) was slow in. Its jitter: with n sync events per rank and step, scaling by a
    step's ratio leaves 1/sqrt(n) of the per-event jitter, which is what "fix everyone"
    (each event capped at its slot's median) removes from the work with each rank-step's
    ratio divided out."""
    ev, m = tl.ev, tl.m
    step = lambda w: tl.step_ns(replay(ev, w, m.x).e)
    ok = tl.key >= 0
    cap = quantile_at(slot[ok], m.w[ok].astype(np.float64), 0.5, slot)
    ok &= ~np.isnan(cap)
    if not ok.any():
        return 0.0, 0.0
    seg = np.repeat(np.arange(len(ev.ranks)), np.diff(ev.off))
    B = int(tl.key.max()) // tl.slots + 1
    u, inv, n = np.unique(seg[ok] * B + tl.key[ok] // tl.slots, return_inverse=True, return_counts=True)
    f = np.bincount(inv, weights=m.w[ok].astype(np.float64)) / np.maximum(np.bincount(inv, weights=cap[ok]), 1.0)
    step_no = (u % B) % (tl.steps + 1)             # the key holds (role * (steps + 1) + step)
    level_of = quantile_at(step_no, f, 0.5, step_no)
    ratio = (f / np.maximum(level_of, 1e-3))[inv]
    fixed, level = m.w.copy(), m.w.copy()
    fixed[ok] = (m.w[ok] / np.maximum(ratio, 1.0)).astype(np.int64)
    level[ok] = (m.w[ok] / np.maximum(ratio, 1e-3)).astype(np.int64)
    cap = quantile_at(slot[ok], level[ok].astype(np.float64), 0.5, slot)
    capped = np.where(np.isnan(cap), level, np.minimum(level, cap)).astype(np.int64)
    jitter = (step(level) - step(capped)) / np.sqrt(float(np.mean(n)))
    return base_step - step(fixed), jitter


def _slow_nodes(rows: dict, own: dict, stage_of: dict) -> list:
    """[(node, ranks, {rank: own work / reference})] for nodes of several ranks that all work
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
        # a slow machine slows its ranks alike; two slow ranks of unequal excess are two ranks
        if lo >= NODE_SLOW and lo - 1 >= NODE_ALIKE * (hi - 1):
            out.append((node, sorted(ratio), ratio))
    return sorted(out, key=lambda t: -min(t[2].values()))


def _span(members: list) -> str:
    if len(members) > 1 and members == list(range(members[0], members[-1] + 1)):
        return f"ranks {members[0]}-{members[-1]}"
    return "ranks " + ", ".join(map(str, members[:16])) + (", …" if len(members) > 16 else "")


def runq_in_own_work(tl: Timeline, tails: tuple) -> dict:
    """Per rank: the runqueue wait (ns per step) that falls inside its own work in the step
    window, i.e. inside [arrival - own work, arrival] of its sync events.

    `tails`: (rank, start, end) of the runnable tail of each recorded off-CPU interval (the
    wait for a CPU after a wake-up, or the whole interval of a preempted thread): the events
    over the tracer's threshold (1 ms by default), of every thread of the rank's process."""
    ev, m = tl.ev, tl.m
    rk, ts, te = tails
    ranks = ev.ranks.astype(np.int64)
    out = {int(r): 0.0 for r in ranks.tolist()}
    sel = tl.inwin & (m.w > 0)
    mine = np.isin(rk, ranks)
    if tl.steps <= 0 or not sel.any() or not mine.any():
        return out
    # one time line for all ranks, rank after rank: a rank's own-work windows do not overlap
    # (its events are sequential), so the wait inside them is F(end) - F(start), F(t) = the
    # window time before t on that line
    we_abs = ev.a[sel].astype(np.int64)
    ws_abs = we_abs - m.w[sel]
    t0 = min(int(ws_abs.min()), int(ts[mine].min()))
    span = max(int(we_abs.max()), int(te[mine].max())) - t0 + 1
    if span * (len(ranks) + 1) >= np.iinfo(np.int64).max // 2:
        return out                                   # not on one int64 line: no figure
    pos = {int(r): i for i, r in enumerate(ranks.tolist())}
    wi = np.searchsorted(ranks, ev.rank[sel]) * span
    ws, we = ws_abs - t0 + wi, we_abs - t0 + wi
    o = np.argsort(ws, kind="stable")
    ws, we = ws[o], we[o]
    cum = np.r_[0, np.cumsum(we - ws)]

    def before(t):
        i = np.searchsorted(ws, t, side="right")
        j = np.maximum(i - 1, 0)
        part = np.clip(np.minimum(t, we[j]) - ws[j], 0, None)
        return np.where(i > 0, cum[j] + part, 0)

    ti = np.searchsorted(ranks, rk[mine]) * span
    inside = before(te[mine] - t0 + ti) - before(ts[mine] - t0 + ti)
    tot = np.bincount(np.searchsorted(ranks, rk[mine]), weights=inside.astype(np.float64), minlength=len(ranks))
    for r, i in pos.items():
        out[r] = float(tot[i]) / tl.steps
    return out


def _own_runq(own_rq: dict | None, r: int, excess_step_ns: float, steps: int) -> dict | None:
    """The rank's runqueue wait inside its own work against its peers' median, ns per step,
    and the difference as a share of its excess own work (None: no runqueue tails, no excess)."""
    if not own_rq or r not in own_rq or len(own_rq) < 2 or excess_step_ns <= 0 or steps <= 0:
        return None
    peers = float(np.median([v for k, v in own_rq.items() if k != r]))
    return {"mine": own_rq[r], "peers": peers, "share": (own_rq[r] - peers) / excess_step_ns, "steps": steps}


def _offcpu_cause(rows: dict, r: int, excess_total_ns: float, traced_ns: int,
                  own: dict | None = None) -> tuple[str, str]:
    """cpu-contention or io when the rank's off-CPU time of that reason is an outlier among
    the ranks and lines up with its excess own work.

    Each reason whose time is an outlier on absolute floors and covers OFFCPU_EXPLAINS_WEAK
    of the excess is weighed; the cause is the one that is the larger multiple of its peers'
    median (on a saturated machine a rank stalled on I/O also waits longer in the runqueue,
    by a factor of its peers' wait, while its I/O wait is its own). It is named when it
    passes alone (an outlier on a scale that also has a share of the excess as floor,
    covering OFFCPU_EXPLAINS, OFFCPU_EXPLAINS_RUNQUEUE for the runqueue), or when the
    weighed waits together cover OFFCPU_EXPLAINS_RUNQUEUE of the excess. Runqueue wait counts
    that way only when its wait per off-CPU interval is STARVED_PER_WAIT times its peers' (when the
    kernel's totals give the number of intervals). Below that it counts, alone, when `own`
    (`_own_runq`: its runqueue wait inside its own work) exceeds its peers' by
    OFFCPU_EXPLAINS_RUNQUEUE of its excess own work and by the absolute floor over the
    session: where it waited says what its excess is, which a handful of ranks' totals (an
    outlier test on 3 peers) cannot."""
    if r not in rows:
        return "compute/unknown", ""
    # the scale when the peers' times agree closely (a MAD near 0): an absolute floor, a share
    # of the excess to explain (a 6 ms/step fsync on a 50 ms step is plenty), a share of the
    # session (a long session's scattered waits are no outlier)
    base = max(OFFCPU_FLOOR_MS, OFFCPU_FLOOR_TRACED * traced_ns / 1e6)
    floor = max(base, OFFCPU_FLOOR_SHARE * excess_total_ns / 1e6)
    found = {}
    for reason, cause in (("io", "io"), ("runqueue", "cpu-contention")):
        vals = {k: x.offcpu_ms.get(reason, 0.0) for k, x in rows.items()}
        peers = float(np.median([v for k, v in vals.items() if k != r]))
        extra_ms = vals[r] - peers
        share = extra_ms * 1e6 / max(excess_total_ns, 1)
        per_wait = _per_wait_ratio(rows, r, reason) if reason == "runqueue" else None
        if per_wait is not None and per_wait < STARVED_PER_WAIT:
            # more waits, not longer ones: woken more often, or starved where it works
            if own is not None and own["share"] >= OFFCPU_EXPLAINS_RUNQUEUE \
                    and (own["mine"] - own["peers"]) * own["steps"] >= base * 1e6:
                found[reason] = dict(cause=cause, share=own["share"], alone=True,
                                     ratio=vals[r] / max(peers, OFFCPU_FLOOR_MS),
                                     why=f"{own['mine'] / 1e6:.1f} ms/step waiting for a CPU inside its own work vs "
                                         f"a peer median of {own['peers'] / 1e6:.1f} ms, {own['share']:.0%} of its "
                                         f"excess own work ({vals[r]:.0f} ms of runqueue wait in all vs {peers:.0f} ms, "
                                         f"{per_wait:.1f}x its peers' per off-CPU interval)")
            continue
        if robust_z(vals, base)[r] >= OFFCPU_Z and share >= OFFCPU_EXPLAINS_WEAK:
            need = OFFCPU_EXPLAINS_RUNQUEUE if reason == "runqueue" else OFFCPU_EXPLAINS
            z = robust_z(vals, floor)[r]
            found[reason] = dict(cause=cause, share=share, alone=z >= OFFCPU_Z and share >= need,
                                 ratio=vals[r] / max(peers, OFFCPU_FLOOR_MS),
                                 why=f"{vals[r]:.0f} ms off-CPU in {reason} wait vs a peer median of "
                                     f"{peers:.0f} ms (z {z:.1f}), {share:.0%} of its excess own work")
    none = "compute/unknown", "no CPU or I/O wait of its own explains it (off-CPU times weighed)"
    if not found:
        return none
    reason = max(found, key=lambda k: found[k]["ratio"])
    f = found[reason]
    if not (f["alone"] or sum(x["share"] for x in found.values()) >= OFFCPU_EXPLAINS_RUNQUEUE):
        return none
    why = "it spent " + f["why"]
    other = next((k for k in found if k != reason), None)
    if other:
        why += (f"; also {found[other]['why'].split(' (z')[0]} ({found[other]['ratio']:.1f}x its peers', "
                f"against {f['ratio']:.1f}x for {reason})")
    return f["cause"], why


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
    peers = float(np.median([v for k, v in per.items() if k != r]))
    return per[r] / peers if peers > 0 else None


def _starved_rank(rows: dict, tl: Timeline, traced_ns: int):
    """The rank starved of CPU, if one is: (rank, share of its transfers it lost, per-wait
    ratio, why) or None.

    Starved: its runqueue wait is an outlier (the floors of `_offcpu_cause`) and each wait
    is STARVED_PER_WAIT times its peers'. Its extra runqueue wait per step beyond what its
    excess own work holds was spent inside its calls, where the other members of its
    collectives and the receivers of its sends wait for it: its what-if takes that share
    `f` out of the transfers it takes part in (`_starved_x`). The kernel gives the wait per
    process, not per call, so it is spread over the transfers in proportion to their length."""
    vals = {k: x.offcpu_ms.get("runqueue", 0.0) for k, x in rows.items()}
    if len(vals) < 3 or tl.steps <= 0:
        return None
    base = max(OFFCPU_FLOOR_MS, OFFCPU_FLOOR_TRACED * traced_ns / 1e6)
    z = robust_z(vals, base)
    r = max(vals, key=vals.get)
    per_wait = _per_wait_ratio(rows, r)
    if z[r] < OFFCPU_Z or per_wait is None or per_wait < STARVED_PER_WAIT:
        return None
    ev, m = tl.ev, tl.m
    peers = float(np.median([v for k, v in vals.items() if k != r]))
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
    return r, f, per_wait, why


def _starved_x(tl: Timeline, r: int, f: float) -> np.ndarray:
    """Transfers with rank `r`'s starvation taken out: every event of a collective instance it
    is in, its own events, and the events that depend on one of its (its sends' receivers),
    shortened by the share `f`."""
    ev, m = tl.ev, tl.m
    sel = ev.rank == r
    has = ev.inst >= 0
    sel |= has & np.isin(ev.inst, np.unique(ev.inst[sel & has]))
    if len(ev.dep_idx):
        src = np.repeat(np.arange(len(ev.a)), np.diff(ev.dep_ptr))
        sel[src[ev.rank[ev.dep_idx] == r]] = True
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
    node = net.extra.get("node")
    vals = {k: x.offcpu_ms.get("runqueue", 0.0) for k, x in rows.items()}
    if node is None or net.extra.get("rdma") or len(vals) < 3 or tl.steps <= 0:   # RDMA: no TCP timers
        return None
    base = max(OFFCPU_FLOOR_MS, OFFCPU_FLOOR_TRACED * traced_ns / 1e6)
    z = robust_z(vals, base)
    on_node = [k for k, x in rows.items() if x.node == node]
    if not on_node:
        return None
    r = max(on_node, key=lambda k: vals[k])
    peers = float(np.median([v for k, v in vals.items() if k != r]))
    extra_ns = (vals[r] - peers) * 1e6 / tl.steps
    per_wait = _per_wait_ratio(rows, r)
    if z[r] < OFFCPU_Z or extra_ns < STARVED_SHARE * net.saving_ns or per_wait is None \
            or per_wait < STARVED_PER_WAIT:
        return None
    why = (f"it spent {vals[r]:.0f} ms waiting in the runqueue vs a peer median of {peers:.0f} ms "
           f"(z {z[r]:.1f}), {extra_ns / 1e6:.1f} ms/step more, {per_wait:.1f}x its peers' wait each time "
           f"it came back from off-CPU; the transfers slowed with retransmits in "
           f"flight on {node}'s connections ({net.why.split(';')[0]}) are what a rank answering late "
           f"causes without any loss: fixing them would save {net.saving_ns / 1e6:.1f} ms/step, and a "
           "lossy link leaves its ranks on CPU")
    return Candidate("rank", [r], net.saving_ns, f"rank {r}", cause="cpu-contention", why=why,
                     score=round(z[r], 2), extra={"starved": True, "replay": net.extra.get("replay"), "own_ms": own.get(r, 0.0) / 1e6,
                            "peers_ms": peers_own.get(r, 0.0) / 1e6})


def _network(c: Calls, tl: Timeline, rows: dict, retx):
    """The node whose connections retransmit while transfers are in flight, if concentrated:
    (node, events hit, evidence, share, top rank, single rank?)."""
    ts, rk, nodes = retx[:3]
    if len(ts) < RETX_MIN:
        return None
    ev, m = tl.ev, tl.m
    # the events with any retransmit in their transfer window (few): each node's are among them
    k = np.searchsorted(ts, ev.e, side="right") - np.searchsorted(ts, m.ready, side="left")
    cand = np.flatnonzero((k > 0) & tl.inwin)
    lo, hi = m.ready[cand], ev.e[cand]
    by_node: dict = {}
    for nd in sorted({n for n in nodes if n is not None}):
        sel = np.array([n == nd for n in nodes])
        t = ts[sel]
        hit = (np.searchsorted(t, hi, side="right") - np.searchsorted(t, lo, side="left")) > 0
        # retransmits of this node that fall in some transfer window
        inwin = np.zeros(len(t), bool)
        if hit.any():
            order = np.argsort(lo[hit])
            l, h = lo[hit][order], np.maximum.accumulate(hi[hit][order])
            i = np.searchsorted(l, t, side="right") - 1
            inwin = (i >= 0) & (h[np.maximum(i, 0)] >= t)
        by_node[nd] = (int(inwin.sum()), cand[hit], rk[sel][inwin])
    total = sum(v[0] for v in by_node.values())
    if total < RETX_MIN:
        return None
    node = max(by_node, key=lambda k: by_node[k][0])
    n, hit_idx, owners = by_node[node]
    hit = np.zeros(len(ev.a), bool)
    hit[hit_idx] = True
    if n < RETX_SHARE * total or hit.sum() < RETX_MIN_EVENT_SHARE * tl.inwin.sum():
        return None
    owners = owners[owners >= 0]
    rank, single = None, False
    if len(owners):
        u, cnt = np.unique(owners, return_counts=True)
        rank = int(u[np.argmax(cnt)])
        node_ranks = [r for r, v in rows.items() if v.node == node]
        single = len(node_ranks) == 1 or cnt.max() >= RETX_SHARE * len(owners)
    if rank is None:
        rank = min((r for r, v in rows.items() if v.node == node), default=None)
    clean = m.x[~hit & tl.inwin]
    slow = m.x[hit]
    why = (f"{n} of {total} retransmits inside transfers are on {node}'s connections"
           f"{f' (rank {rank} owns {int(np.max(np.unique(owners, return_counts=True)[1]))})' if len(owners) else ''}; "
           f"transfers with one in flight take {np.median(slow) / 1e6:.1f} ms at median vs "
           f"{(np.median(clean) if len(clean) else 0) / 1e6:.1f} ms without, in {int(hit.sum())} of "
           f"{int(tl.inwin.sum())} sync events, with arrivals on time{_proxy_evidence(rows, node)}")
    return node, hit, why, round(n / total, 2), rank, single


def _proxy_evidence(rows: dict, node) -> str:
    """NCCL's own view of the same link, when the profiler plugin summarised proxy operations:
    how long the node's ranks' sends waited on the network against the other ranks'."""
    mine = [v.net_wait_ms for v in rows.values() if v.node == node and v.net_wait_ms is not None]
    others = [v.net_wait_ms for v in rows.values() if v.node != node and v.net_wait_ms is not None]
    if not mine or not others:
        return ""
    return (f"; NCCL's proxy: {node}'s ranks' sends waited up to {max(mine):.0f} ms on the network, "
            f"the other ranks' {float(np.median(others)):.0f} ms at median")


def _rdma_network(tl: Timeline, rows: dict, ports: list | None):
    """The RDMA port whose loss or congestion counters rose while transfers that cross it were
    in flight, if concentrated there, as `_network` returns it: (node, events hit, evidence,
    share, a rank behind it, that rank alone?). A transfer crosses a port when a rank behind it
    exchanges with a rank on another node (a collective instance or a send/recv pair holding
    both); it is hit when it overlaps a sampling interval in which the counters rose. A port
    no traced rank uses is evidence for nobody."""
    if not ports:
        return None
    ev, m = tl.ev, tl.m
    n = len(ev.a)
    if not n:
        return None
    nodes = sorted({v.node for v in rows.values() if v.node is not None})
    code = np.full(int(ev.rank.max()) + 1, -1)
    for r, v in rows.items():
        if 0 <= r < len(code) and v.node is not None:
            code[r] = nodes.index(v.node)
    has = ev.inst >= 0
    ni = int(ev.inst.max()) + 1 if has.any() else 0
    src = np.repeat(np.arange(n), np.diff(ev.dep_ptr))
    found = []
    for p in ports:
        behind = [r for r in p.ranks if r in rows]
        if not behind or p.node not in nodes:
            continue
        mine = np.isin(ev.rank, behind)
        far = (code[ev.rank] >= 0) & (code[ev.rank] != nodes.index(p.node))
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
        found.append((int(p.count[during].sum()), p, hit, behind, during))
    total = sum(f[0] for f in found)
    if total < RETX_MIN:
        return None
    k, p, hit, behind, during = max(found, key=lambda f: f[0])
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
    return p.node, hit, why, round(k / total, 2), behind[0] if single else min(node_ranks), single


def rdma_notes(ports: list) -> list[str]:
    """One line per RDMA port whose loss or congestion counters rose: what, and whose it is."""
    out = []
    for p in ports:
        who = ((f"rank {p.ranks[0]}" if len(p.ranks) == 1 else _span(p.ranks)) + f", mapped by {p.how}"
               if p.ranks else "no traced rank uses it")
        what = ", ".join(f"{c:,} {w}" for w, c in p.totals())
        out.append(f"RDMA: node {p.node}, {p.label()} ({who}): {what} during the trace")
    return out

def _straggler(k: Candidate, tl: Timeline, rows: dict, base_step: float, excess: dict, base) -> Straggler:
    if k.kind == "spread":
        who = k.extra["worst"]
    elif k.kind == "network":
        who = k.ranks[0] if k.extra.get("single") else max(
            k.ranks, key=lambda r: (rows[r].retransmits_in_window, rows[r].net_wait_ms or 0.0))
    else:
        who = max(k.ranks, key=lambda r: excess.get(r, 0.0))
    row = rows.get(who)
    named = set(k.ranks) if k.kind != "spread" else set()
    evidence = _evidence(k, tl, rows, excess, base_step)
    prop = _propagated(tl, named, base_step, k.extra.get("replay"), base) if named else []
    kind = "rank" if k.kind in ("rank",) or (k.kind == "network" and k.extra.get("single")) else k.kind
    if kind == "network":
        kind = "node"
    if kind in ("stage", "node") and len(k.ranks) == 1:    # a stage or node of one rank is that rank
        kind = "rank"
    group = None if kind == "rank" else (k.label if k.kind != "network" else f"node {k.extra['node']}")
    return Straggler(rank=who, node=row.node if row else None, pod=row.pod if row else None,
                     cause=k.cause, score=round(float(k.score), 2), evidence=evidence,
                     saving_ms_per_step=k.saving_ns / 1e6, saving_pct=100.0 * k.saving_ns / base_step,
                     group=group, kind=kind, ranks=sorted(k.ranks) if k.kind != "spread" else [],
                     propagated=prop)


def _evidence(k: Candidate, tl: Timeline, rows: dict, excess: dict, base_step: float) -> str:
    pred = (base_step - k.saving_ns) / 1e6
    what_if = f"replayed without it the step takes {pred:.1f} ms instead of {base_step / 1e6:.1f} ms"
    if k.kind == "rank":
        r = k.ranks[0]
        x = k.extra
        return (f"rank {r}'s own work (between its blocking calls) is {x['own_ms']:.1f} ms/step vs "
                f"{x['peers_ms']:.1f} ms for its peers' median; {what_if}"
                f"{'; ' + k.why if k.why else ''}")
    if k.kind == "spread":
        return f"{k.why}; the slowdown is spread over many ranks, not one"
    return f"{k.why}; {what_if}"


def _propagated(tl: Timeline, named: set, base_step: float, fixed, base) -> list[str]:
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
    out = []
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
