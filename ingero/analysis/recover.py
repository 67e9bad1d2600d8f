"""Communicators created before tracing began, recovered from what their calls show.

A call on a communicator the probes did not see created has no identity
(bpf/nccl.c: comm_id_hash 0, rank -1, a seq counted from the first call seen),
only its handle, the ``ncclComm_t`` pointer. Per handle, (node, pid, pointer),
the calls show a sequence of collectives (op, count, datatype) and when each
ended. The handles of one communicator share that sequence, and on a blocking
NCCL the members of one collective instance end together: none returns before
the last member has arrived. So:

1. Pair handles of different ranks: each collective of one is matched to the
   other's call of the same op, count and datatype that ended nearest to it.
   The pair agrees when most matches have the same seq offset (after a late
   start each rank's first seen instance differs, by a constant); its gap is
   the median end-time difference of those matches. Where calls block until
   their collective completes, the calls of one all-reduce, all-gather,
   reduce-scatter or all-to-all instance overlap in time on every member: a
   pair whose matched calls often do not overlap is two communicators (two
   node-local ones in lockstep agree on their sequence but fail this).
2. Group handles into communicators, the most constrained handles first (those
   whose calls overlap the fewest others'), then the tightest pairs (complete linkage):
   a rank is in a group once, and every pair across two groups must agree on
   the same offsets (and, where calls only enqueue work, not be much looser
   than the groups' own pairs).
3. Handles that only send and receive (a pipeline's) are linked by their
   peers instead (``_p2p_groups``), which also give each member its rank.
4. Give each group a synthetic id, each member its rank in it (the order of
   the global ranks: a world communicator's, and a split's keyed by rank;
   checked against the peers of its sends and receives), and seq numbers
   shifted so that one instance has one number on every member. Calls made
   before every member was traced (the probes reach the ranks, or the nodes,
   at different times) are left out: collective instances before the first
   one every member was traced in, and leading sends or receives of a pair of
   ranks whose partner calls were not traced, so the rest pair in order.

Confidence of a group: the mean agreement of its pairs times how clearly the
look-alikes outside it are not members (``_separation``; 1 where blocking calls of a
member overlap no handle's outside the group: its communicator can be no other), times the share of
its sends and receives that fit its rank order; 1 when nothing outside looks
like it. Handles that match nobody (one traced rank, a communicator of one)
stay unknown and are left out, with a warning.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MIN_AGREE = 0.8     # share of matched collectives that must agree (op, count, datatype, seq offset)
GAP = 4.0           # a group joins another only within this many times its own end-time gap
NOISE_NS = 20_000   # end-time noise any pair has: a uprobe costs 5-20 us (DESIGN.md)
MIN_CALLS = 3       # collectives a handle needs in the trace to be matched
# every member of these needs every other member's data: on a blocking NCCL no call of an
# instance returns before every member has entered it (a broadcast's root may leave first)
SYMMETRIC = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL")
MAX_APART = 0.02    # blocking calls: share of a pair's symmetric calls that may not overlap (clock noise)
SURE_APART = 0.1    # ... a share that proves two handles are not one communicator
P2P_SHIFT = 2       # shifts tried around the nearest-in-time one when pairing sends with receives
MIN_OVERLAP_CALLS = 10   # symmetric calls a pair needs to tell blocking calls from enqueued ones
# where calls only enqueue work nothing proves that handles with one sequence are one
# communicator rather than several in step (the lab's per-node pairs on its GPU-like device
# were merged into one of 4): the confidence says so
ENQUEUED_CONF = 0.5
# below this a handle outside the group matched nearly as well as its members (in a tp=2,
# pp=2,dp=2 lab job the embedding pairs of first and last stage beside their tensor-parallel
# twins in step: 0.15): the grouping is a guess and its calls are left out
MIN_CONF = 0.3


def communicators(con, tbl: pa.Table, ops: list[str], warnings: list[str]) -> pa.Table:
    """`tbl` (calls.load's rows, with ``ptr``, ``cnt``, ``dtype``) with every call on an
    unknown communicator given the identity its group recovers, or left out."""
    if tbl.num_rows == 0 or "ptr" not in tbl.column_names:
        return tbl
    unknown = unknown_comm(tbl, ops)
    if not unknown.any():             # every call's communicator is known: the common case
        return tbl
    cols = _Cols.of(tbl)
    handles: dict[tuple, list[int]] = {}
    for i in np.flatnonzero(unknown & (cols.ptr != 0) & (cols.grank >= 0)).tolist():
        handles.setdefault(cols.handle(i), []).append(i)
    p2p, sym = np.isin(cols.opname, ("SEND", "RECV")), np.isin(cols.opname, SYMMETRIC)
    hs = [_Handle(k, np.asarray(rows), cols.grank[rows[0]], cols.t, cols.d, cols.seq, cols.callkey, p2p, sym)
          for k, rows in handles.items()]
    groups, pairs, blocking = _group([h for h in hs if len(h.coll) >= MIN_CALLS])
    groups += _p2p_groups([h for h in hs if len(h.coll) < MIN_CALLS and len(h.send_recv) >= MIN_CALLS],
                          cols.opname, cols.peer, cols.count, cols.t, cols.d)
    fix = _Fix(cols, unknown)
    for g in groups:
        fix.apply(g, pairs, blocking)
    fix.warn(warnings)
    if fix.recovered_ranks:
        _device_note(con, sorted(fix.recovered_ranks), warnings)
    return fix.table(tbl)


@dataclass
class _Cols:
    """The columns of calls.load's rows that recovery reads, as arrays."""

    comm: np.ndarray
    ptr: np.ndarray
    opname: np.ndarray
    grank: np.ndarray
    crank: np.ndarray
    node: np.ndarray
    pid: np.ndarray
    seq: np.ndarray
    peer: np.ndarray
    count: np.ndarray
    callkey: np.ndarray
    t: np.ndarray             # group calls' times: the group's (`_group_times`)
    d: np.ndarray

    @classmethod
    def of(cls, tbl: pa.Table) -> _Cols:
        def ints(name: str, null: int, dtype=np.int64) -> np.ndarray:
            return tbl.column(name).fill_null(null).to_numpy().astype(dtype)

        def objs(name: str) -> np.ndarray:
            return np.asarray(tbl.column(name).to_pylist(), dtype=object)

        opname, grank, count = objs("op"), ints("grank", -1), ints("cnt", -1)
        t, d = _group_times(opname, grank, tbl.column("t").to_numpy().astype(np.int64),
                            tbl.column("d").to_numpy().astype(np.int64))
        return cls(comm=ints("comm", 0, np.uint64), ptr=ints("ptr", 0, np.uint64), opname=opname, grank=grank,
                   crank=ints("crank", -1), node=objs("node"), pid=ints("pid", 0), seq=ints("seq", 0),
                   peer=ints("peer", -1), count=count, callkey=_call_keys(opname, count, objs("dtype")), t=t, d=d)

    def handle(self, i: int) -> tuple:
        """The handle of call `i`: (node, pid, communicator pointer)."""
        return self.node[i], int(self.pid[i]), int(self.ptr[i])


class _Fix:
    """The recovered identities, applied group by group, and what was left out."""

    def __init__(self, cols: _Cols, unknown: np.ndarray):
        self.cols, self.unknown = cols, unknown
        self.comm, self.seq, self.crank = cols.comm.copy(), cols.seq.copy(), cols.crank.copy()
        self.keep = ~unknown | (cols.grank < 0)   # calls without a rank: calls.load leaves them out and says so
        self.cut = np.zeros(len(self.keep), bool)      # calls whose partners the trace had not reached yet
        self.guessed = np.zeros(len(self.keep), bool)  # calls of groups too unsure to use
        self.lines: list[str] = []
        self.guesses: list[str] = []
        self.recovered_ranks: set = set()

    def apply(self, g: _Group, pairs: dict, blocking: bool) -> None:
        """Give the group's calls its synthetic id, ranks and aligned seq numbers, or leave
        them out when its confidence is under MIN_CONF."""
        c, seq, cut = self.cols, self.cols.seq, self.cut
        members = sorted(g.members, key=lambda h: h.grank)
        cid = _synthetic_id(members)
        order = {h.grank: i for i, h in enumerate(members)} if not g.crank else \
            {h.grank: g.crank[h] for h in members}
        aligned = [h for h in members if len(h.coll) and h in g.base]   # (send/receive groups: none)
        firsts = [int(seq[h.coll].min()) + g.base[h] for h in aligned]
        base, full = min(firsts, default=0), max(firsts, default=0)   # full: first instance all were traced in
        for h in members:
            self.comm[h.rows] = cid
            self.crank[h.rows] = order[h.grank]
            self.keep[h.rows] = True
            if h in aligned:
                self.seq[h.coll] = seq[h.coll] + g.base[h] - base
                cut[h.coll[self.seq[h.coll] < full - base]] = True
            else:
                cut[h.coll] = True    # a stray collective or two on a send/receive handle: unaligned
        fit = _p2p_fit(members, c.opname, c.peer, order, c.t, c.d, cut)
        conf = g.sep * fit if g.crank else \
            g.agree * (1.0 if g.forced else _separation(g, pairs, blocking)) * fit
        if conf < MIN_CONF:
            for h in members:
                self.keep[h.rows] = cut[h.rows] = False
                self.guessed[h.rows] = True
            self.guesses.append(f"{_ranks(order)} ({conf:.2f})")
            return
        unproven = not g.crank and not blocking
        if unproven:
            conf = min(conf, ENQUEUED_CONF)
        self.recovered_ranks.update(order)
        how = "call sequences" if not g.crank else "send/receive pairs"
        self.lines.append(f"communicator {cid:#018x}: recovered from {how}, {len(members)} ranks "
                          f"({_ranks(order)}), confidence {conf:.2f}"
                          + ("" if fit == 1.0 else f" (its sends and receives fit the rank order at {fit:.2f})")
                          + (" (calls only enqueue work: look-alike communicators with the same sequence, "
                             "e.g. one per node, cannot be told apart by time)" if unproven else ""))

    def warn(self, warnings: list[str]) -> None:
        warnings += self.lines[:8]
        if len(self.lines) > 8:
            warnings.append(f"{len(self.lines) - 8} more communicators recovered from their calls")
        if self.guesses:
            warnings.append(f"{int(self.guessed.sum())} calls on {len(self.guesses)} groups of handles whose calls "
                            f"agree were left out: handles outside them matched nearly as well (ranks "
                            f"{'; '.join(self.guesses[:8])}; confidence below {MIN_CONF})")
        if self.cut.any():
            warnings.append(f"{int(self.cut.sum())} calls on recovered communicators made before every member was "
                            "traced were left out (the probes reached the ranks at different times)")
        lost = np.flatnonzero(self.unknown & ~self.keep & ~self.guessed).tolist()
        if lost:
            who = sorted({int(self.cols.grank[i]) for i in lost if self.cols.grank[i] >= 0})
            warnings.append(f"{len(lost)} calls on {len({self.cols.handle(i) for i in lost})} communicators created "
                            f"before tracing began matched no other rank's calls and were left out"
                            + (f" (ranks {_ranks(who)})" if who else "")
                            + ": trace every rank of the job, or start tracing before the job")

    def table(self, tbl: pa.Table) -> pa.Table:
        out = tbl
        for name, arr in (("comm", self.comm), ("seq", self.seq), ("crank", self.crank)):
            j = out.column_names.index(name)
            out = out.set_column(j, name, pa.array(arr, type=out.schema.field(name).type))
        keep = self.keep & ~self.cut
        return out.filter(pa.array(keep)) if not keep.all() else out


def unknown_comm(tbl: pa.Table, ops: list[str]) -> np.ndarray:
    """Per row of `tbl`: a collective or p2p call on a communicator without identity."""
    data = pc.is_in(tbl.column("op"), value_set=pa.array(ops)).to_numpy(zero_copy_only=False)
    return data & (tbl.column("comm").fill_null(0).to_numpy() == 0)


class _Handle:
    """One process's calls on one unknown communicator handle."""

    def __init__(self, key, rows, grank, t, d, seq, callkey, p2p, sym):
        self.key, self.rows, self.grank = key, rows, int(grank)
        self.coll = rows[~p2p[rows]]
        self.send_recv = rows[p2p[rows]]
        o = np.argsort(t[self.coll] + d[self.coll], kind="stable")
        self.end = (t[self.coll] + d[self.coll])[o]
        self.start = t[self.coll][o]
        self.seq = seq[self.coll][o]
        self.ck = callkey[self.coll][o]
        self.sym = sym[self.coll][o]

    def __repr__(self):
        return f"_Handle(rank {self.grank}, {self.key})"


class _Pair:
    __slots__ = ("agree", "offset", "gap", "apart", "nsym")

    def __init__(self, agree: float, offset: int, gap: float, apart: float = 0.0, nsym: int = 0):
        self.agree, self.offset, self.gap, self.apart, self.nsym = agree, offset, gap, apart, nsym

    def flipped(self) -> "_Pair":
        return _Pair(self.agree, -self.offset, self.gap, self.apart, self.nsym)


def match(a: _Handle, b: _Handle) -> _Pair:
    """How well `b`'s collectives line up with `a`'s: each of `a`'s calls is matched to `b`'s
    call of the same op, count and datatype that ended nearest to it. (agreement: the share
    of matches with the most common seq offset; that offset, b - a; the median end-time gap
    of those matches; the share of them whose calls did not overlap in time)."""
    jb = np.full(len(a.end), -1, np.int64)
    for k in np.intersect1d(a.ck, b.ck).tolist():
        ia, ib = np.flatnonzero(a.ck == k), np.flatnonzero(b.ck == k)
        e = b.end[ib]
        j = np.searchsorted(e, a.end[ia])
        lo, hi = np.clip(j - 1, 0, len(e) - 1), np.clip(j, 0, len(e) - 1)
        jb[ia] = ib[np.where(np.abs(e[lo] - a.end[ia]) <= np.abs(e[hi] - a.end[ia]), lo, hi)]
    same = jb >= 0
    if not same.any():
        return _Pair(0.0, 0, float("inf"))
    off = np.where(same, b.seq[jb] - a.seq, 0)
    vals, cnts = np.unique(off[same], return_counts=True)
    k = int(vals[np.argmax(cnts)])
    ok = np.flatnonzero(same & (off == k))
    agree = len(np.unique(jb[ok])) / min(len(a.end), len(b.end))
    sym = ok[a.sym[ok]]
    apart = (a.end[sym] < b.start[jb[sym]]) | (b.end[jb[sym]] < a.start[sym])
    return _Pair(float(agree), k, float(np.median(np.abs(b.end[jb[ok]] - a.end[ok]))),
                 float(apart.mean()) if len(sym) else 0.0, len(sym))


class _Group:
    def __init__(self, h: _Handle):
        self.members = [h]
        self.base = {h: 0}        # aligned seq = seq + base
        self.gap = 0.0            # widest end-time gap of its pairs
        self.agrees: list[float] = []
        self.crank: dict[_Handle, int | None] = {}   # handle -> its rank in the communicator, from
                                                     # p2p peers (empty: a group of collectives)
        self.sep = 1.0                   # p2p groups: the clearest margin of their links
        self.forced = False              # a member's calls overlap no handle's outside it

    @property
    def agree(self) -> float:
        return float(np.mean(self.agrees)) if self.agrees else 1.0


def _group(hs: list[_Handle]) -> tuple[list[_Group], dict, bool]:
    """Recovered communicators (groups of 2 or more handles), every agreeing pair, and
    whether the calls block (the overlap test holds for some pair)."""
    pairs: dict[tuple[int, int], _Pair] = {}
    for i, a in enumerate(hs):
        for j in range(i + 1, len(hs)):
            b = hs[j]
            if a.grank == b.grank or not np.isin(a.ck[:64], b.ck).any():
                continue
            p = match(a, b)
            if p.agree >= MIN_AGREE:
                pairs[(id(a), id(b))], pairs[(id(b), id(a))] = p, p.flipped()
    blocking = any(p.nsym >= MIN_OVERLAP_CALLS and p.apart <= MAX_APART for p in pairs.values())
    edges = {k: p for k, p in pairs.items() if not (blocking and p.apart > MAX_APART)}
    partners: dict[int, set] = {}
    for ia, ib in edges:
        partners.setdefault(ia, set()).add(ib)
    group = {id(h): _Group(h) for h in hs}
    # the most constrained handles first (one whose calls overlap only one other's has its
    # communicator there), then the tightest: under load, wake-ups spread a blocking call's
    # ends over milliseconds and look-alikes in step can end closer than true members
    for (ia, ib), p in sorted(edges.items(),
                              key=lambda kv: (min(len(partners[kv[0][0]]), len(partners[kv[0][1]])), kv[1].gap)):
        ga, gb = group[ia], group[ib]
        if ga is gb or {h.grank for h in ga.members} & {h.grank for h in gb.members}:
            continue
        if any((id(x), id(y)) not in edges for x in ga.members for y in gb.members):
            continue
        cross = [(x, y, edges[(id(x), id(y))]) for x in ga.members for y in gb.members]
        widest = max(q.gap for _, _, q in cross)
        if (not blocking and len(ga.members) + len(gb.members) > 2
                and widest > GAP * max(ga.gap, gb.gap) + NOISE_NS):
            continue
        x0, y0, q0 = cross[0]
        shift = ga.base[x0] - q0.offset - gb.base[y0]
        if any(ga.base[x] - q.offset != gb.base[y] + shift for x, y, q in cross):
            continue          # the pairs disagree on which calls are one instance
        for y in gb.members:
            ga.base[y] = gb.base[y] + shift
            group[id(y)] = ga
        ga.members += gb.members
        ga.gap = max(ga.gap, gb.gap, widest)
        ga.agrees += gb.agrees + [q.agree for _, _, q in cross]
    out, seen = [], set()
    for g in group.values():
        if id(g) not in seen and len(g.members) > 1:
            seen.add(id(g))
            ids = {id(h) for h in g.members}
            g.forced = blocking and any(partners[id(h)] <= ids for h in g.members)
            out.append(g)
    return out, pairs, blocking


def _p2p_groups(hs: list[_Handle], opname, peer, count, t, d) -> list[_Group]:
    """Communicators of handles that only send and receive (a pipeline's), each member's rank
    from the peers: a send of `count` to peer q on handle X is received on some handle Y
    whose receive names X's rank as its peer, so linking X's sends to Y's receives gives
    X rank p (Y's peer) and Y rank q. Per (X, peer, count), the Ys whose receives pair with
    the sends, best first: no receive that ended before its send began (where calls block),
    then the smallest end-time gap; the best one's margin over the next is its link's
    confidence. Links join groups tightest first (a channel's next candidate where its best
    was taken); a group is as sure as its clearest link."""
    calls: dict[tuple, list[int]] = {}
    for h in hs:
        for i in h.send_recv.tolist():
            calls.setdefault((h, opname[i], int(peer[i]), int(count[i])), []).append(i)
    chans = {k: np.asarray(sorted(v, key=lambda i: t[i])) for k, v in calls.items()}
    recvs = [(k, v) for k, v in chans.items() if k[1] == "RECV" and len(v) >= MIN_CALLS]
    links = []
    for (x, op, q, c), s in chans.items():
        if op != "SEND" or len(s) < MIN_CALLS:
            continue
        cands = []
        for (y, _, p, c2), r in recvs:
            if c2 == c and y.grank != x.grank:
                agree, early, gap = _p2p_match(s, r, t, d)
                if agree >= MIN_AGREE:
                    cands.append((early > MAX_APART, gap, y, p))
        if not cands:
            continue
        cands.sort(key=lambda z: (z[0], z[1]))
        bad, gap, y, p = cands[0]
        sep = 1.0
        if len(cands) > 1 and not (cands[1][0] and not bad):
            sep = max(0.0, 1.0 - (gap + NOISE_NS) / (cands[1][1] + NOISE_NS))
        links.append((gap, x, y, p, q, sep))
        # the others too (no margin of their own), should the best be taken by then
        links += [(g2, x, y2, p2, q, 0.0) for b2, g2, y2, p2 in cands[1:] if b2 == bad]
    group = {h: _Group(h) for h in hs}
    for g in group.values():
        g.crank = {g.members[0]: None}
        g.sep = 0.0
    for gap, x, y, p, q, sep in sorted(links, key=lambda z: z[0]):
        gx, gy = group[x], group[y]
        if gx.crank[x] not in (None, p) or gy.crank[y] not in (None, q):
            continue
        merged = {**gx.crank, x: p} if gx is gy else {**gx.crank, **gy.crank, x: p}
        merged[y] = q
        ranks = [r for r in merged.values() if r is not None]
        if len(set(ranks)) < len(ranks) or len({h.grank for h in merged}) < len(merged):
            continue
        gx.crank = merged
        if gx is not gy:
            gx.members += gy.members
            for h in gy.members:
                group[h] = gx
        gx.sep = max(gx.sep, gy.sep, sep)      # one clear link names the pair
    out = []
    for g in {id(g): g for g in group.values()}.values():
        if len(g.members) > 1 and all(r is not None for r in g.crank.values()):
            out.append(g)
    return out


def _p2p_match(s: np.ndarray, r: np.ndarray, t, d) -> tuple[float, float, float]:
    """(agreement, share of receives that ended before their send began, median end-time gap)
    of sends `s` against receives `r` (rows, in time order): each send is matched to the
    receive that ended nearest to it; they agree at the most common index offset. Where
    receivers wake late (a busy machine) nearest in time stops agreeing; then the calls are
    paired in order (first in, first out per peer, at `_shift`'s shift) and agree as far as
    no receive ends before its send began."""
    es, er = t[s] + d[s], t[r] + d[r]
    j = np.clip(np.searchsorted(er, es), 0, len(er) - 1)
    lo = np.maximum(j - 1, 0)
    j = np.where(np.abs(er[lo] - es) < np.abs(er[j] - es), lo, j)
    off = j - np.arange(len(s))
    vals, cnts = np.unique(off, return_counts=True)
    ok = np.flatnonzero(off == vals[np.argmax(cnts)])
    agree = len(np.unique(j[ok])) / min(len(s), len(r))
    early = float(np.mean(er[j[ok]] < t[s[ok]] - NOISE_NS))
    gap = float(np.median(np.abs(er[j[ok]] - es[ok])))
    if agree < MIN_AGREE:
        k, lag = _shift(s, r, t, d)
        if lag is not None and np.mean(lag < -NOISE_NS) <= MAX_APART:
            a, b = (es[-k:], er) if k < 0 else (es, er[k:])
            m = len(lag)
            early = float(np.mean(lag < -NOISE_NS))
            agree = (1.0 - early) * m / min(len(s), len(r))
            gap = float(np.median(np.abs(b[:m] - a[:m])))
    return agree, early, gap


def _separation(g: _Group, pairs: dict, blocking: bool) -> float:
    """How clearly the look-alikes outside `g` (handles whose calls agree with a member's)
    are not members: per look-alike, its overlap test (blocking calls: a share of calls
    that did not overlap, conclusive from SURE_APART) or its end-time gap against g's own;
    the weakest of them. 1.0 when nothing outside looks like g."""
    ids = {id(h) for h in g.members}
    worst = 1.0
    for (a, b), p in pairs.items():
        if a in ids and b not in ids:
            by_gap = max(0.0, 1.0 - (g.gap + NOISE_NS) / (p.gap + NOISE_NS))
            by_overlap = min(1.0, p.apart / SURE_APART) if blocking else 0.0
            worst = min(worst, max(by_gap, by_overlap))
    return worst


def _p2p_fit(members: list[_Handle], opname, peer, order: dict, t, d, cut) -> float:
    """Share of sends/receives whose peer is a member under the assumed rank order and whose
    (sender, receiver) pair is seen from both ends; marks in `cut` the leading calls of a
    pair whose partners the trace start did not reach. 1.0 with no sends or receives."""
    rows: dict[tuple[str, tuple[int, int]], list[int]] = {}
    for h in members:
        for i in h.send_recv.tolist():
            p = int(peer[i])
            me = order[h.grank]
            pair = (me, p) if opname[i] == "SEND" else (p, me)
            rows.setdefault((opname[i], pair), []).append(i)
    total = sum(len(v) for v in rows.values())
    if not total:
        return 1.0
    n = len(members)
    good = 0
    for (op, pair), idx in rows.items():
        other = rows.get(("RECV" if op == "SEND" else "SEND", pair))
        if max(pair) < n and min(pair) >= 0 and other:
            good += len(idx)
            if op == "SEND":
                _trim(np.asarray(idx), np.asarray(other), t, d, cut)
    return good / total


def _trim(sends: np.ndarray, recvs: np.ndarray, t, d, cut) -> None:
    """Mark the leading sends or receives of one rank pair that have no partner in the
    trace (one side was traced from a later call), so that calls.events pairs the rest in
    order."""
    k, _ = _shift(sends, recvs, t, d)
    s, r = sends[np.argsort(t[sends], kind="stable")], recvs[np.argsort(t[recvs], kind="stable")]
    if k > 0:
        cut[r[:k]] = True
    elif k < 0:
        cut[s[:-k]] = True


def _shift(sends: np.ndarray, recvs: np.ndarray, t, d) -> tuple[int, np.ndarray | None]:
    """(shift, per pair the receive's end minus its send's start) of one channel's sends and
    receives, which pair in order (NCCL's p2p is first in, first out per peer): send i with
    receive i + shift. The shift: near the one most sends have to the receive ending nearest
    them, one whose receives (but a few, MAX_APART) do not end before their send began (data
    cannot arrive before it is sent), then the shortest median wait from send to receive
    end. (the nearest one, None) when no shift leaves MIN_CALLS pairs."""
    s, r = sends[np.argsort(t[sends], kind="stable")], recvs[np.argsort(t[recvs], kind="stable")]
    ts, er = t[s], t[r] + d[r]
    j = np.clip(np.searchsorted(er, ts), 0, len(er) - 1)
    lo = np.maximum(j - 1, 0)
    j = np.where(np.abs(er[lo] - ts) < np.abs(er[j] - ts), lo, j)
    vals, cnts = np.unique(j - np.arange(len(s)), return_counts=True)
    k0 = int(vals[np.argmax(cnts)])
    best = None
    for k in range(k0 - P2P_SHIFT, k0 + P2P_SHIFT + 1):
        a, b = (ts[-k:], er) if k < 0 else (ts, er[k:])
        m = min(len(a), len(b))
        if m < MIN_CALLS:
            continue
        lag = b[:m] - a[:m]
        score = (float(np.mean(lag < -NOISE_NS)) > MAX_APART, float(np.median(np.abs(lag))))
        if best is None or score < best[0]:
            best = (score, k, lag)
    return (best[1], best[2]) if best else (k0, None)


def _group_times(opname, grank, t, d) -> tuple[np.ndarray, np.ndarray]:
    """(start, duration) of each call as the matching weighs it: a call inside a group only
    records work, which moves in the group's outermost end, so it takes that end call's
    times (rows in calls.load's order: by rank, then time)."""
    from ingero.analysis.calls import _depth

    gs = opname == "GROUP_START"
    ge = np.isin(opname, ("GROUP_END", "GROUP_SIMULATE_END"))
    if not gs.any():
        return t, d
    op = np.where(gs, -1, np.where(ge, -2, 1))
    before, after = _depth(op, np.r_[True, grank[1:] != grank[:-1]])
    outer_start = gs & (before == 0)
    g = np.cumsum(outer_start) - 1
    outer_end = ge & (before == 1) & (after == 0)
    te = np.full(int(g.max()) + 2, -1, np.int64)
    de = np.zeros(len(te), np.int64)
    te[g[outer_end]], de[g[outer_end]] = t[outer_end], d[outer_end]
    sel = ((before > 0) & (op == 1) & (g >= 0))
    sel[sel] = te[g[sel]] >= 0
    t2, d2 = t.copy(), d.copy()
    t2[sel], d2[sel] = te[g[sel]], de[g[sel]]
    return t2, d2


def _call_keys(op, cnt, dtype) -> np.ndarray:
    """One integer per (op, count, datatype)."""
    names: dict[tuple, int] = {}
    codes = np.array([names.setdefault((o, dt), len(names)) for o, dt in zip(op.tolist(), dtype.tolist())],
                     dtype=np.int64)
    return codes * (1 << 44) + (cnt & ((1 << 44) - 1))


def _synthetic_id(members: list[_Handle]) -> int:
    """A stable non-zero 64-bit id from the members' handles."""
    text = ";".join(f"{h.key[0]}/{h.key[1]}/{h.key[2]:x}" for h in members)
    v = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return v or 1


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def _device_note(con, ranks: list[int], warnings: list[str]) -> None:
    """Late-attached ranks without device times: say why (the plugin loads at NCCL init)."""
    try:
        dev = {r[0] for r in con.execute("SELECT DISTINCT global_rank FROM nccl_profiler_events "
                                         "WHERE device_start_ns IS NOT NULL").fetchall()}
    except Exception:        # a trace without the table
        dev = set()
    missing = [r for r in ranks if r not in dev]
    if missing:
        warnings.append(f"ranks {_ranks(missing)} were traced after their NCCL communicators were created: "
                        "no device times (NCCL loads a profiler plugin only when it creates a communicator; "
                        "start the job with NCCL_PROFILER_PLUGIN set to Ingero's plugin to have them)")
