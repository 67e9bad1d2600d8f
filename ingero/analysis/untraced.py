"""A synchronisation between steps that the trace does not show.

A job may hold its ranks together with something other than NCCL: a barrier over
gloo or the rendezvous store, a host-side reduction, a checkpoint every rank waits
for. Between two steps every rank then sits outside NCCL at once, and those that
finished their step early wait there for the last one. Read naively, that wait is
own work: the ranks that waited look as busy as the one they waited for, and the
replay, which keeps their "work", finds little to gain from fixing the slow rank.

The sign of it (``between_steps``): at (nearly) every step boundary the idle
stretches of all ranks share an instant (the last rank finished its step before
the first began the next), and the ranks enter that stretch over a large part of
a step. Such a boundary is then judged as a collective over every rank
(``with_sync``): each rank enters it when its step's last call returned and
leaves when the last rank has entered, which is when the sync could release
them at the earliest; its next step's own work starts there.

Only host timing on one stream is read this way: on a device the gaps between NCCL
kernels hold the compute kernels, which no trace here sees.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ingero.analysis.calls import OPS, Calls, Events
from ingero.analysis.steps import Timeline

SHARED = 0.9         # share of the step boundaries where every rank's idle must overlap
SPREAD = 0.2         # the ranks enter it over at least this share of a step (median boundary):
                     # beyond what the release of a collective that ends a step spreads them by
MIN_BOUNDARIES = 3   # fewer boundaries than this: nothing to tell a habit from a coincidence


@dataclass
class Untraced:
    """Where the untraced sync held every rank between two steps."""

    ranks: np.ndarray    # the ranks it holds (global ranks)
    pid: np.ndarray      # each rank's process
    enter: np.ndarray    # (ranks, boundaries): the return of its step's last call
    leave: np.ndarray    # (ranks, boundaries): the last entry, or its next call if that came first

    def note(self) -> str:
        wait = np.median(self.leave - self.enter, axis=1) / 1e6
        top = np.argsort(-wait)[:3]
        who = ", ".join(f"rank {int(self.ranks[i])} {wait[i]:.1f} ms" for i in top if wait[i] > 0)
        return (f"between steps every rank waits outside NCCL for the last one to finish its step "
                f"({self.enter.shape[1]} step boundaries; the longest waits per step: {who}): a "
                "synchronisation the trace does not show (a barrier over gloo or the store, a host-side "
                "reduction); it is judged as a collective over every rank")


def between_steps(c: Calls, ev: Events, tl: Timeline) -> Untraced | None:
    """The untraced sync of the module's docstring, or None."""
    if ev.prev_ptr is not None or c.launch is not None or tl.steps < MIN_BOUNDARIES + 1:
        return None
    last, first = _boundary_events(ev, tl)
    held = np.flatnonzero((last >= 0).any(axis=1))
    if len(held) < 2:
        return None
    last, first = last[held], first[held]
    whole = (last >= 0).all(axis=0) & (first >= 0).all(axis=0)
    if whole.sum() < MIN_BOUNDARIES or _spans_every_rank(c, ev.ranks[held]):
        return None
    enter, nxt = ev.e[last[:, whole]], ev.a[first[:, whole]]
    latest = enter.max(axis=0)
    shared = latest <= nxt.min(axis=0)
    step_ns = tl.step_ns(ev.e)
    if shared.mean() < SHARED or step_ns <= 0 or np.median(latest - enter.min(axis=0)) < SPREAD * step_ns:
        return None
    return Untraced(ranks=ev.ranks[held], pid=_pids(c, ev.ranks[held]), enter=enter, leave=np.minimum(latest, nxt))


def with_sync(c: Calls, u: Untraced) -> Calls:
    """`c` with the untraced sync as one collective instance per boundary (a communicator of
    its own over `u.ranks`), a call per rank from its entry to its release."""
    nr, nb = u.enter.shape
    comm = len(c.comm_hash)
    inst0 = len(c.inst_size)
    add = {
        "rank": np.repeat(u.ranks, nb).astype(c.rank.dtype),
        "t": u.enter.ravel().astype(c.t.dtype),
        "d": (u.leave - u.enter).ravel().astype(c.d.dtype),
        "op": np.full(nr * nb, OPS.index("ALL_REDUCE") + 1, c.op.dtype),
        "comm": np.full(nr * nb, comm, c.comm.dtype),
        "seq": np.tile(np.arange(nb), nr).astype(c.seq.dtype),
        "inst": (inst0 + np.tile(np.arange(nb), nr)).astype(c.inst.dtype),
        "peer": np.full(nr * nb, -1, c.peer.dtype),
        "pid": np.repeat(u.pid, nb).astype(c.pid.dtype),
    }
    rows = {f: np.concatenate([getattr(c, f), v]) for f, v in add.items()}
    # by (rank, time); at equal times the sync before the call that follows it
    after = np.r_[np.ones(c.n, np.int8), np.zeros(nr * nb, np.int8)]
    o = np.lexsort((after, rows["t"], rows["rank"]))
    rows = {f: v[o] for f, v in rows.items()}
    changed: dict[str, Any] = {
        **rows,
        "comm_hash": np.r_[c.comm_hash, 0].astype(c.comm_hash.dtype),
        "inst_comm": np.r_[c.inst_comm, np.full(nb, comm)].astype(c.inst_comm.dtype),
        "inst_op": np.r_[c.inst_op, np.full(nb, OPS.index("ALL_REDUCE") + 1)].astype(c.inst_op.dtype),
        "inst_size": np.r_[c.inst_size, np.full(nb, nr)].astype(c.inst_size.dtype),
        "comm_members": {**c.comm_members, comm: sorted(int(r) for r in u.ranks)},
    }
    return replace(c, **changed)


def _boundary_events(ev: Events, tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, steps - 1) each: the event that ends step k on each rank and the one that begins
    step k + 1 (k = 1 .. steps - 1), -1 where the rank has none."""
    B = tl.steps + 1
    step = np.where(tl.inwin, (tl.key // max(tl.slots, 1)) % B, -1)
    seg = np.repeat(np.arange(len(ev.ranks)), np.diff(ev.off))
    idx = np.flatnonzero(step >= 1)
    cell = seg[idx] * B + step[idx]
    last = np.full(len(ev.ranks) * B, -1, np.int64)
    np.maximum.at(last, cell, idx)
    first = np.full(len(ev.ranks) * B, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first, cell, idx)
    first[first == np.iinfo(np.int64).max] = -1
    ends, opens = last.reshape(-1, B), first.reshape(-1, B)
    return ends[:, 1:B - 1], opens[:, 2:B]


def _spans_every_rank(c: Calls, ranks: np.ndarray) -> bool:
    """Does a traced collective's communicator hold every one of `ranks`? (Then the job has
    its sync in the trace.)"""
    want = set(int(r) for r in ranks)
    used = set(np.unique(c.inst_comm).tolist())
    return any(want <= set(m) for k, m in c.comm_members.items() if k in used)


def _pids(c: Calls, ranks: np.ndarray) -> np.ndarray:
    """The process of each rank's last call."""
    last = np.searchsorted(c.rank, ranks, side="right") - 1
    return c.pid[last]
