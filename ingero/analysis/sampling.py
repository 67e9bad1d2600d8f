"""Which windows of a long session to judge, and the session's counts, from one cheap pass.

A session holding more calls than the replay budget (``windows.REPLAY_BUDGET``) is judged on
a bounded sample of its windows (``windows.analyse_windows``). What the sample needs from
the whole session comes from one DuckDB aggregate over nccl_events (``prepass``), grouped by
time bucket (``BUCKETS`` of equal length over the session), rank and op, no call read into
numpy:

* the per-rank counts of the table: collective calls per op (and over the session's
  threshold), counted as the engine counts them (calls that returned, of a rank, on a
  communicator with a seq), but for the calls of groups closed by ncclGroupSimulateEnd,
  which the engine leaves out: the ncclGroupSimulateEnd calls are counted
  (``Prepass.simulate_ends``), and a session with some is not sampled;
* the sends and receives per (communicator, sender, receiver) before each bucket, so that a
  judged window pairs its own in order from the session's start (``calls.P2pCounts``): a
  peer's global rank is the one the sends and receives of that communicator rank show;
* each rank's time inside collectives per bucket: where the ranks are most uneven (the rank
  with the least time inside collectives, relative to the median rank: the late arriver
  waits least), which ``Prepass.choose`` samples beside the windows spread evenly;
* about how long a step is, from the collective made least often through the session
  (``_least_recurring``), so that a window spans whole steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.analysis.calls import _FROM, _RETURNED, OPS, P2pCounts
from ingero.analysis.steps import MIN_INSTANCES
from ingero.schema import COLLECTIVE_OPS

BUCKETS = 64            # time buckets of the pre-pass over the session: where a window may start


@dataclass
class Prepass:
    """The session's calls counted per time bucket (``prepass``)."""

    first: int                  # the session's first call (ns)
    width: int                  # a bucket's length (ns); bucket b: [first + b * width, first + (b + 1) * width)
    buckets: int
    ranks: np.ndarray           # global ranks with calls, sorted
    per_op: dict                # rank -> {op: collective calls}, the whole session
    slow: dict | None           # rank -> collectives over the threshold (None: no threshold)
    coll_ns: np.ndarray         # (bucket, rank index): time inside collectives of the calls starting in it
    calls: np.ndarray           # (bucket, rank index): calls starting in it
    p2p: dict                   # "b", "key", "keys", "n": sends and receives by bucket (``_pairs``)
    step_ns: float = 0.0        # about a step (``_least_recurring``); 0: not known
    simulate_ends: int = 0      # ncclGroupSimulateEnd calls that returned ncclSuccess

    @property
    def unkeyed(self) -> int:
        """Sends and receives whose communicator or peer the pre-pass cannot name (a
        communicator the trace began after, recovered from call sequences by the engine):
        the counts before a window would miss them."""
        return self.p2p["unkeyed"]

    def p2p_before(self, bucket: int) -> P2pCounts:
        """The sends and receives before `bucket`, per (communicator hash, sender, receiver)."""
        out = P2pCounts()
        p = self.p2p
        n = np.bincount(p["key"], weights=np.where(p["b"] < bucket, p["n"], 0), minlength=len(p["keys"]))
        for (send, comm, src, dst), k in zip(p["keys"], n.tolist()):
            if k:
                (out.sends if send else out.recvs)[(comm, src, dst)] = int(k)
        return out

    def unevenness(self, start: int, span: int) -> float:
        """1 - (the least time inside collectives of a rank in buckets [start, start + span))
        / the median rank's, over the ranks with calls there: 0 when every rank waits alike."""
        ns = self.coll_ns[start:start + span].sum(axis=0)
        live = self.calls[start:start + span].sum(axis=0) > 0
        if live.sum() < 2:
            return 0.0
        med = float(np.median(ns[live]))
        return 1.0 - float(ns[live].min()) / med if med > 0 else 0.0

    def choose(self, span: int, even: int, uneven: int) -> list[tuple[int, str]]:
        """Start buckets of windows `span` buckets long that do not overlap, in time order,
        each with why: `even` spread evenly (centred on equal shares of the session), then up
        to `uneven` where the ranks are most uneven (``unevenness``)."""
        span = max(1, min(span, self.buckets))
        picked: list[tuple[int, str]] = []
        free = lambda s: all(s + span <= t or t + span <= s for t, _ in picked)
        for i in range(even):
            s = int(np.clip(round((i + 0.5) * self.buckets / even - span / 2), 0, self.buckets - span))
            if free(s):
                picked.append((s, "spread"))
        score = [self.unevenness(s, span) for s in range(self.buckets - span + 1)]
        for s in sorted(range(len(score)), key=lambda s: (-score[s], s)):
            if sum(why == "uneven" for _, why in picked) >= uneven:
                break
            if free(s) and score[s] > 0:
                picked.append((s, "uneven"))
        return sorted(picked)


    def stand_for(self, starts: list[int], span: int, judged: list[bool]) -> list[int]:
        """How many buckets with calls each window (its start bucket, `span` buckets long)
        stands for: each bucket goes to the judged window whose unevenness is nearest its own
        (of the `span` buckets around it), of equals the nearest in time; so the windows where
        the ranks were most uneven stand for the buckets like them, and the windows spread
        evenly for the rest."""
        out = [0] * len(starts)
        mine = [j for j, ok in enumerate(judged) if ok]
        if not mine:
            return out
        span = max(1, min(span, self.buckets))
        of = {j: self.unevenness(starts[j], span) for j in mine}
        for b in np.flatnonzero(self.calls.sum(axis=1) > 0).tolist():
            u = self.unevenness(int(np.clip(b - span // 2, 0, self.buckets - span)), span)
            j = min(mine, key=lambda j: (abs(u - of[j]), abs(b - starts[j] - span / 2)))
            out[j] += 1
        return out


def prepass(con, first: int, last: int, slow_collective_ms: float | None = None,
            buckets: int = BUCKETS) -> Prepass:
    """One aggregate over the session's NCCL calls on `con` (see the module's docstring)."""
    width = max(-(-(int(last) + 1 - int(first)) // buckets), 1)
    slow = "" if slow_collective_ms is None else \
        f", count(*) FILTER (WHERE e.duration_ns > {int(slow_collective_ms * 1e6)}) AS slow"
    p2p = "e.peer >= 0 AND e.op IN ('SEND', 'RECV')"     # (a collective's peer: -1 or none)
    rows = con.execute(f"""
        SELECT (e.timestamp_ns - {int(first)}) // {width} AS b, COALESCE(r.rank, e.global_rank, e.rank) AS grank,
               e.op::VARCHAR AS op, e.comm_id_hash AS comm,
               CASE WHEN {p2p} THEN e.rank END AS crank, CASE WHEN {p2p} THEN e.peer END AS peer,
               count(*) AS n, sum(e.duration_ns)::DOUBLE AS ns{slow}{_FROM}
        WHERE {_RETURNED} AND e.op IN ({', '.join(repr(o) for o in [*OPS, 'GROUP_SIMULATE_END'])})
          AND ((COALESCE(e.comm_id_hash, 0) <> 0 OR COALESCE(e.comm, 0) <> 0) AND e.seq IS NOT NULL
               OR (e.op = 'GROUP_SIMULATE_END' AND e.ret = 0))
        GROUP BY ALL""").fetchnumpy()
    sim = np.asarray(rows["op"], dtype=object) == "GROUP_SIMULATE_END"
    keep = ~np.ma.getmaskarray(rows["grank"]) & ~sim
    col = {k: (v.filled(0 if k == "comm" else -1) if np.ma.isMaskedArray(v) else v)[keep] for k, v in rows.items()}
    b = np.clip(col["b"].astype(np.int64), 0, buckets - 1)
    grank, op, n = col["grank"].astype(np.int64), np.asarray(col["op"], dtype=object), col["n"].astype(np.int64)
    ranks = np.unique(grank)
    ri = np.searchsorted(ranks, grank)
    coll = np.isin(op, list(COLLECTIVE_OPS))
    coll_ns = np.zeros((buckets, len(ranks)))
    np.add.at(coll_ns, (b[coll], ri[coll]), col["ns"][coll].astype(np.float64))
    calls = np.zeros((buckets, len(ranks)), np.int64)
    np.add.at(calls, (b, ri), n)
    per_op: dict = {}
    slow_by: dict | None = None if slow_collective_ms is None else {int(r): 0 for r in ranks}
    for r, o, k, s in zip(grank[coll].tolist(), op[coll].tolist(), n[coll].tolist(),
                          (col["slow"][coll] if slow else n[coll]).tolist()):
        d = per_op.setdefault(r, {})
        d[o] = d.get(o, 0) + k
        if slow_by is not None:
            slow_by[r] += int(s)
    least = _least_recurring(b[coll], col["comm"][coll], op[coll], grank[coll], n[coll])
    return Prepass(int(first), width, buckets, ranks, per_op, slow_by, coll_ns, calls,
                   _pairs(b[~coll], grank[~coll], op[~coll], col, ~coll, n[~coll]),
                   (int(last) - int(first)) / least if least else 0.0, int(rows["n"][sim].sum()))


def _least_recurring(b: np.ndarray, comm: np.ndarray, op: np.ndarray, grank: np.ndarray, n: np.ndarray) -> int:
    """Calls per member rank of the collective (one communicator's one op) made least often,
    of those made MIN_INSTANCES times at least and through the session, as ``steps``
    chooses its markers: the n calls per member of one made through the session span (in
    buckets, ``b``) half of (n - 1) / n at least of the longest span of a collective sharing
    a member with it (a collective made only at start-up is in one bucket or two). A step
    is about the session's length over it (longer, where it is made only every few steps:
    the windows are then wider than they need be). 0: none."""
    if not len(n):
        return 0
    _, ci = np.unique(comm.astype(np.uint64), return_inverse=True)
    ops, oi = np.unique(op.astype(str), return_inverse=True)
    u, key = np.unique(ci.ravel().astype(np.int64) * len(ops) + oi.ravel(), return_inverse=True)
    key = key.ravel()
    k, r = np.divmod(np.unique(key * (int(grank.max()) + 2) + grank + 1), int(grank.max()) + 2)   # its members
    per = np.bincount(key, weights=n, minlength=len(u)) / np.bincount(k, minlength=len(u))
    lo, hi = np.full(len(u), np.iinfo(np.int64).max), np.zeros(len(u), np.int64)
    np.minimum.at(lo, key, b)
    np.maximum.at(hi, key, b)
    longest, whole = np.zeros(r.max() + 1, np.int64), np.zeros(len(u), np.int64)
    np.maximum.at(longest, r, hi[k] - lo[k] + 1)          # per rank, the longest span of a collective it makes
    np.maximum.at(whole, k, longest[r])
    through = 2 * per * (hi - lo + 1) >= (per - 1) * whole
    per = per[through] if through.any() else per
    per = per[per >= MIN_INSTANCES]
    return int(per.min()) if len(per) else 0


def _pairs(b, grank, op, col: dict, sel: np.ndarray, n: np.ndarray) -> dict:
    """The sends and receives by bucket (``b``), each of ``keys[key]``: (is a send,
    communicator hash, sender, receiver), with ``n`` calls; the peer's global rank is the
    one the calls of that communicator rank show; ``unkeyed``: the calls left out, whose
    peer's global rank is not known."""
    comm = col["comm"][sel].astype(np.uint64)
    crank, peer = col["crank"][sel].astype(np.int64), col["peer"][sel].astype(np.int64)
    ch, ci = np.unique(comm, return_inverse=True)            # communicators as codes
    ci = ci.ravel().astype(np.int64)
    span = int(max(crank.max(initial=0), peer.max(initial=0))) + 2
    me = ci * span + crank + 1
    known, first = np.unique(me[crank >= 0], return_index=True)
    g = grank[crank >= 0][first]
    pk = ci * span + peer + 1
    pg = np.full(len(pk), -1, np.int64)
    if len(known):
        i = np.minimum(np.searchsorted(known, pk), len(known) - 1)
        hit = (peer >= 0) & (known[i] == pk)
        pg[hit] = g[i[hit]]
    send = op == "SEND"
    ok = pg >= 0
    src, dst = np.where(send, grank, pg)[ok], np.where(send, pg, grank)[ok]
    w = int(max(src.max(initial=0), dst.max(initial=0))) + 1
    full = ((ci[ok] * w + src) * w + dst) * 2 + send[ok]
    u, key = np.unique(full, return_inverse=True)
    keys = [(bool(k & 1), int(ch[k // 2 // w // w]), int(k // 2 // w % w), int(k // 2 % w)) for k in u.tolist()]
    return {"b": b[ok], "key": key.ravel(), "keys": keys, "n": n[ok], "unkeyed": int(n[~ok].sum())}
