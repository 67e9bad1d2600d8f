"""The calls of a session as numpy columns, and the blocking points they form.

A rank blocks on other ranks at *sync events*: an ungrouped collective or
point-to-point call, or the outermost ``ncclGroupEnd`` of a group (the calls
inside a group only record work; the group end waits for all of it). Each sync
event has an arrival (the call, or the group's start), an end (the return) and
its dependencies:

* a collective instance (communicator, seq, op): every member's arrival (the
  collectives of one group are one instance: a coalesced launch ends when all have run);
* a receive: the arrival of the sync event holding the matching send (sends and
  receives are paired in order per (communicator, sender, receiver): NCCL's
  per-communicator seq of p2p calls does not match across ranks);
* a send: the matching receive's arrival, when the send returned after that
  receive was posted (a rendezvous; a send that returned earlier was eager).

Calls in a group whose outermost end is ``ncclGroupSimulateEnd`` never ran: NCCL
only estimated their time (``groupLaunch`` skips the launch when given simInfo).
``load`` leaves them out here, once, for every judgement (see ``simulated``).

On the device (the NCCL profiler plugin's rows) there are no group calls: the
operations of one kernel launch (a ncclGroupStart/End on a communicator, an
all-to-all's sends and receives, a coalesced launch) carry one group number and
run as one kernel with one interval, so they form one sync event, whose
dependencies are its members' collective instances and p2p pairs. Instances
launched together are one instance of the replay (every member rank's kernel
holds all of them; the smallest id stands for them).

A GPU runs each stream in order, and the streams of one process side by side (each
PyTorch process group has its own). Where the plugin recorded the stream, a device
event follows the events of its rank that had ended when it started, the latest of
each stream (and its own stream's previous one, whatever the clocks say): the compute
that launched it waited for them. An earlier event still running on another stream
when it started ran beside it, and is none of its predecessors (``_stream_order``).
"""

from __future__ import annotations

import warnings as warnings_
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ingero.analysis import recover
from ingero.errors import IngeroError
from ingero.schema import COLLECTIVE_OPS, NCCL_OK_RETS, P2P_OPS

OPS = list(COLLECTIVE_OPS) + list(P2P_OPS)      # op code = index + 1; GROUP_START -1, GROUP_END -2
_SEND, _RECV = OPS.index("SEND") + 1, OPS.index("RECV") + 1
_GS, _GE = -1, -2

_GROUP_OPS = ("GROUP_START", "GROUP_END", "GROUP_SIMULATE_END")
_FROM = """
    FROM nccl_events e
    LEFT JOIN (SELECT node, pid, any_value(rank) AS rank, any_value(pod) AS pod
               FROM ranks GROUP BY node, pid) r
      ON r.node IS NOT DISTINCT FROM e.node AND r.pid = e.pid"""
_RETURNED = (f"e.ret IN ({', '.join(map(str, NCCL_OK_RETS))}) AND e.timestamp_ns IS NOT NULL "
             "AND e.duration_ns IS NOT NULL")
_QUERY = f"""
    SELECT COALESCE(r.rank, e.global_rank, e.rank) AS grank, e.node, COALESCE(r.pod, e.pod) AS pod,
           e.pid, e.op, e.comm_id_hash AS comm, e.seq, e.timestamp_ns AS t, e.duration_ns AS d,
           e.rank AS crank, e.peer, e.event_id, e.ret, e.comm AS ptr, e.count AS cnt, e.datatype AS dtype{_FROM}
    WHERE {_RETURNED}
      AND ((e.op IN ({', '.join(repr(o) for o in OPS)}) AND (e.comm_id_hash <> 0 OR e.comm <> 0) AND e.seq IS NOT NULL)
           OR e.op IN ({', '.join(repr(o) for o in _GROUP_OPS)}))"""
_ORDER = " ORDER BY grank, t, e.event_id"
# What ``load`` reads of the host calls: every row, unsorted and unfiltered, and numpy orders
# (``_call_order``) and filters them for a fraction of what ORDER BY and a WHERE cost (over the
# artifact's view of the segments, a WHERE is planned into every segment's branch). ``how``
# says what numpy filters by: 1 no communicator hash, 2 a communicator handle, 4 no seq,
# 8 returned ncclSuccess, 16 returned at all (an ok return, with a time and a duration). The
# op as an ENUM (NULL: none of the calls read). Every call that returned is read, the ones it
# cannot place too: coverage.py counts them from this read (``Calls.counted``), with no second
# pass over the calls. None of the columns only the recovery of unknown communicators reads
# (recover.py: it reads _QUERY again).
_HOST_QUERY = f"""
    SELECT COALESCE(r.rank, e.global_rank, e.rank) AS grank, e.node, COALESCE(r.pod, e.pod) AS pod, e.pid,
           TRY_CAST(e.op AS ENUM({', '.join(repr(o) for o in OPS + list(_GROUP_OPS))})) AS op,
           e.comm_id_hash AS comm, e.seq, e.timestamp_ns AS t, e.duration_ns AS d, e.rank AS crank, e.peer,
           e.event_id, (COALESCE(e.comm_id_hash, 0) = 0)::UTINYINT + 2 * (COALESCE(e.comm, 0) <> 0)::UTINYINT
           + 4 * (e.seq IS NULL)::UTINYINT + 8 * COALESCE(e.ret = 0, false)::UTINYINT
           + 16 * COALESCE({_RETURNED}, false)::UTINYINT AS how{_FROM}"""
_NO_HASH, _HANDLE, _NO_SEQ, _RET_OK, _RET = 1, 2, 4, 8, 16
# NULLs read as these (else 0), and numpy's type of each column (else the column's own)
_FILLS = {"grank": -1, "crank": -1, "peer": -1, "ret": -1, "grp": -1}
_TYPES: dict[str, type] = {name: np.int64 for name in ("grank", "pid", "seq", "t", "d", "crank", "peer", "ret", "grp")}
_TYPES.update(comm=np.uint64, event_id=np.uint64, strm=np.uint64)

# The same columns from the NCCL profiler plugin's rows: when the GPU ran each operation
# (device start/end, on the host's clock), NCCL's own communicator hash and seq, and the
# kernel launch it ran in (grp: equal for the operations of one launch of a process on a
# communicator; NULL from plugins that did not record it: each operation on its own).
# A process's operations come in the order of its GPU's own stamps (device_start_raw): the
# plugin puts each on the host clock with the clock fit of the moment it finished, and two
# fits may disagree by more than the microseconds between a short kernel and the next.
_DEVICE_QUERY = f"""
    SELECT COALESCE(r.rank, e.global_rank) AS grank, e.node, COALESCE(r.pod, e.pod) AS pod,
           e.pid, e.op, e.comm_hash AS comm, e.seq, e.device_start_ns AS t,
           e.device_end_ns - e.device_start_ns AS d, e.rank AS crank, e.peer, e.event_id,
           e.group_id AS grp, e.stream AS strm, e.stream IS NOT NULL AS strm_known
    FROM nccl_profiler_events e
    LEFT JOIN (SELECT node, pid, any_value(rank) AS rank, any_value(pod) AS pod
               FROM ranks GROUP BY node, pid) r
      ON r.node IS NOT DISTINCT FROM e.node AND r.pid = e.pid
    WHERE e.device_start_ns IS NOT NULL AND e.device_end_ns IS NOT NULL
      AND e.device_end_ns >= e.device_start_ns AND NOT COALESCE(e.unfinished, false)
      AND e.op IN ({', '.join(repr(o) for o in OPS)}) AND e.seq IS NOT NULL
    ORDER BY grank, min(e.device_start_ns) OVER (PARTITION BY grank, e.node, e.pid), e.node, e.pid,
             e.device_start_raw, t, e.event_id"""


def device_timing(con) -> tuple[bool, str | None]:
    """(use the plugin's device times?, a warning: why not, or which operations they miss).
    Yes when every rank that made NCCL calls has device-timed operations from the plugin."""
    try:
        have = con.execute("SELECT count(*) FROM nccl_profiler_events WHERE device_start_ns IS NOT NULL").fetchall()[0][0]
    except Exception:        # an older trace without the table
        return False, None
    if not have:
        return False, None
    host = {r[0] for r in con.execute(
        "SELECT DISTINCT COALESCE(global_rank, rank) FROM nccl_events WHERE op NOT IN ('GROUP_START', 'GROUP_END')"
    ).fetchall() if r[0] is not None}
    dev = {r[0] for r in con.execute(
        "SELECT DISTINCT global_rank FROM nccl_profiler_events WHERE device_start_ns IS NOT NULL").fetchall()
        if r[0] is not None}
    missing = sorted(host - dev)
    if missing:
        return False, (f"the NCCL profiler plugin's device times cover {len(dev)} of {len(host | dev)} ranks "
                       f"(none from rank {', '.join(map(str, missing[:8]))}{', ...' if len(missing) > 8 else ''}); "
                       "judged on host times")
    return True, device_coverage(con)


# Host calls whose device work the plugin sees as other operations: NCCL 2.28+ runs an
# all-to-all, gather or scatter as grouped sends and receives.
_AS_P2P = ("ALL_TO_ALL", "GATHER", "SCATTER")
# A process's operations in flight when the trace stopped have host calls and no device row
# yet (one per stream, a grouped exchange two): up to this many per type are no gap.
IN_FLIGHT = 2


def device_coverage(con) -> str | None:
    """A warning naming each operation type whose host calls have no device-timed row from
    the plugin (collectives on symmetric memory, copy-engine collectives and CollNet never
    reach its kernel-channel events), with counts; None if none. Counted per process over
    the span the plugin recorded it (its first to its last launch), where every launched
    operation has its row; a process with more than IN_FLIGHT such calls of a type counts."""
    rows = con.execute(f"""
        WITH span AS (SELECT node, pid, min(timestamp_ns) AS lo, max(timestamp_ns) AS hi
                      FROM nccl_profiler_events GROUP BY node, pid),
             host AS (SELECT e.node, e.pid, e.op, count(*) AS n FROM nccl_events e JOIN span s
                        ON s.node IS NOT DISTINCT FROM e.node AND s.pid = e.pid
                      WHERE e.op IN (SELECT unnest(?)) AND e.ret IN ({', '.join(map(str, NCCL_OK_RETS))})
                        AND e.timestamp_ns BETWEEN s.lo AND s.hi
                      GROUP BY e.node, e.pid, e.op),
             dev AS (SELECT node, pid, op, count(*) AS n FROM nccl_profiler_events
                     WHERE device_start_ns IS NOT NULL AND NOT COALESCE(unfinished, false)
                     GROUP BY node, pid, op)
        SELECT h.op, sum(h.n)::BIGINT, sum(CASE WHEN h.n - COALESCE(d.n, 0) > ? THEN h.n - COALESCE(d.n, 0)
                                               ELSE 0 END)::BIGINT
        FROM host h LEFT JOIN dev d ON d.node IS NOT DISTINCT FROM h.node AND d.pid = h.pid AND d.op = h.op
        GROUP BY h.op ORDER BY h.op""", [[o for o in OPS if o not in _AS_P2P], IN_FLIGHT]).fetchall()
    short = [(o, n, k) for o, n, k in rows if k]
    if not short:
        return None
    return ("host calls without device times from the NCCL profiler plugin (symmetric-memory, copy-engine "
            "or CollNet collectives never reach its kernel-channel events): "
            + "; ".join(f"{o}: {k} of {n}" for o, n, k in short)
            + "; their waits are not on the device timeline")


@dataclass
class Calls:
    """One row per call, sorted by (rank, time). ``op``: code (index in OPS + 1, -1 group
    start, -2 group end); ``comm``: communicator code; ``inst``: collective instance id (-1
    for others); ``peer``: the global rank at the other end of a send/recv (-1 unknown)."""

    rank: np.ndarray
    t: np.ndarray
    d: np.ndarray
    op: np.ndarray
    comm: np.ndarray
    seq: np.ndarray
    inst: np.ndarray
    peer: np.ndarray
    pid: np.ndarray
    node_of: dict              # rank -> (node, pod, pid) where it called last
    comm_hash: np.ndarray      # comm code -> hash
    inst_comm: np.ndarray      # instance -> comm code
    inst_op: np.ndarray        # instance -> op code
    inst_size: np.ndarray      # instance -> calls (traced members)
    comm_members: dict         # comm code -> sorted global ranks
    simulated: dict = field(default_factory=dict)   # rank -> calls left out (ncclGroupSimulateEnd)
    # host rows: coverage.py's counts of every call that returned, per (node, global rank):
    # (node, rank, calls, no communicator, no seq, on a handle); device rows: None
    counted: list | None = None
    launch: np.ndarray | None = None   # device rows: the kernel launch of each (-1: its own); host: None
    stream: np.ndarray | None = None   # device rows: the stream of each, a code (-1: not recorded); host: None

    @property
    def n(self) -> int:
        return len(self.t)

    def since(self, t0: int) -> "Calls":
        """The calls from `t0` on, in the same order, with the same instances and communicators."""
        k = self.t >= t0
        rows = {f: getattr(self, f)[k] for f in ("rank", "t", "d", "op", "comm", "seq", "inst", "peer", "pid")}
        return replace(self, **rows, launch=None if self.launch is None else self.launch[k])


def load(con, device: bool = False) -> tuple[Calls, list[str]]:
    """The session's collective, p2p and group calls from `con` (any view of the tables);
    with `device`, the operations as the GPU ran them (nccl_profiler_events)."""
    warnings: list[str] = []
    cols, rows, counted = _rows(con, device, warnings)
    if not len(rows):
        return replace(_no_calls(np.zeros(0, np.uint64)), counted=counted), warnings
    k = _columns(cols, rows, device)
    hashes, k["comm"] = _codes(k.pop("comm_h"))
    simulated_by_rank = _leave_out_simulated(k, warnings)
    if not len(k["o"]):
        return replace(_no_calls(hashes, simulated_by_rank), counted=counted), warnings
    rank, op, comm = k["rank"], k["op"], k["comm"]
    members, peer = _members_and_peers(rank, op, comm, k["crank"], k["peer_c"])
    inst, inst_comm, inst_op, cnt = _instances(rank, op, comm, k["seq"], warnings)
    return Calls(rank=rank, t=k["t"], d=k["d"], op=op, comm=comm, seq=k["seq"], inst=inst, peer=peer,
                 pid=k["pid"], node_of=_where_ranks_are(rank, k["o"], cols), comm_hash=hashes,
                 inst_comm=np.asarray(inst_comm), inst_op=np.asarray(inst_op), inst_size=np.asarray(cnt),
                 comm_members=members, simulated=simulated_by_rank,
                 launch=_launches(rank, k["pid"], comm, k["grp"]) if device else None,
                 stream=k["strm"] if device else None, counted=counted), warnings


def _no_calls(hashes: np.ndarray, simulated_by_rank: dict | None = None) -> Calls:
    z = np.zeros(0, np.int64)
    return Calls(z, z, z, z.astype(np.int8), z, z, z, z, z, {}, hashes, z, z, z, {},
                 simulated=simulated_by_rank or {})


def _rows(con, device: bool, warnings: list[str]) -> tuple[dict, np.ndarray, list | None]:
    """The calls' rows as numpy columns (``_fetch``), the rows that are calls with a rank in
    call order (by rank, time and event id), and the host calls' counts (``Calls.counted``).
    Communicators created before tracing are recovered from the calls (recover.py)."""
    counted: list | None = None if device else []
    with warnings_.catch_warnings():     # (DuckDB notes the Arrow copy of a DB-API result)
        warnings_.simplefilter("ignore", UserWarning)
        if device:                       # rows in call order
            cols = _fetch(con.sql(_DEVICE_QUERY).to_arrow_reader(1 << 20))
        elif cols := _fetch(con.sql(_HOST_QUERY).to_arrow_reader(1 << 20)):
            op, how = _op_codes(cols["op"]), cols["how"]
            call = ((how & _RET) != 0) & (op != 0)
            counted = _counted(cols["node"], cols["grank"], np.flatnonzero(call & (op > 0)), how)
            keep = call & ((op < 0) | (((how & _NO_HASH) == 0) | ((how & _HANDLE) != 0)) & ((how & _NO_SEQ) == 0))
            if not ((op > 0) & keep & ((how & _NO_HASH) != 0)).any():
                return cols, _call_order(_ranked(cols, keep, warnings), cols["t"], cols["event_id"]), counted
            tbl = recover.communicators(con, con.execute(_QUERY + _ORDER).to_arrow_table(), OPS, warnings)
            cols = _fetch(tbl.to_batches())      # rows in call order
    if not cols:
        return cols, np.zeros(0, np.int64), counted
    return cols, np.flatnonzero(_ranked(cols, None, warnings) >= 0), counted


def _ranked(cols: dict, keep: np.ndarray | None, warnings: list[str]) -> np.ndarray:
    """Each row's rank; -1 for the rows not in `keep` (None: every row) and for calls of
    processes without a rank, which a warning counts."""
    rank = cols["grank"]
    lost = int(np.count_nonzero(rank < 0 if keep is None else keep & (rank < 0)))
    if lost:                             # no ranks row, no torchrun RANK, no rank in the communicator
        warnings.append(f"{lost} calls of processes without a rank were left out")
    return rank if keep is None else np.where(keep, rank, -1)


def _counted(node: Coded, grank: np.ndarray, call: np.ndarray, how: np.ndarray) -> list:
    """``Calls.counted`` of the rows `call` (the calls that returned) of `_HOST_QUERY`'s."""
    if not len(call):
        return []
    names = node.names + [None]
    nidx = np.where(node.codes[call] < 0, len(names) - 1, node.codes[call]).astype(np.int64)
    grank = np.maximum(grank[call], -1)                                   # < 0: no rank
    h = how[call]
    no_hash, handle = (h & _NO_HASH) != 0, (h & _HANDLE) != 0
    flags = (no_hash & ~handle, ~no_hash & ((h & _NO_SEQ) != 0), no_hash & handle)
    keys, g = _codes(nidx * (int(grank.max()) + 2) + (grank + 1))
    n = len(keys)
    sums = [np.bincount(g, minlength=n)] + [np.bincount(g, weights=f, minlength=n).astype(np.int64) for f in flags]
    span = int(grank.max()) + 2
    return [(names[k // span], None if k % span == 0 else k % span - 1, *(int(x[i]) for x in sums))
            for i, k in enumerate(keys.tolist())]


def _columns(cols: dict, rows: np.ndarray, device: bool) -> dict:
    """The calls (`rows` of `cols`, in call order) as numpy columns; ``o``: each one's row."""
    op = _op_codes(cols["op"])
    ret_ok = (cols["how"] & _RET_OK) != 0 if "how" in cols else cols["ret"] == 0 if "ret" in cols else None
    k = {"rank": cols["grank"], "t": cols["t"], "d": cols["d"], "op": op, "comm_h": cols["comm"],
         "seq": cols["seq"], "crank": cols["crank"], "peer_c": cols["peer"], "pid": cols["pid"],
         "sim_end": np.zeros(len(op), bool) if ret_ok is None else _simulate_ends(cols["op"], ret_ok),
         "grp": cols["grp"] if device else None,
         "strm": _stream_codes(cols["strm"], cols["strm_known"]) if device else None}
    k = {name: None if a is None else a[rows] for name, a in k.items()}
    k["o"] = rows
    if device:
        k["t"], k["d"] = _monotonic(k["rank"], k["t"], k["d"])
    return k


def _leave_out_simulated(k: dict, warnings: list[str]) -> dict:
    """Drop from the columns `k` the calls of groups closed by ncclGroupSimulateEnd (seq
    renumbered as launched); rank -> calls left out."""
    sim = simulated(k["rank"], k["op"], k.pop("sim_end"))
    if not sim.any():
        return {}
    k["seq"] = launched_seq(k["rank"], k["op"], k["comm"], k["seq"], sim)
    ur, n = np.unique(k["rank"][sim & (k["op"] > 0)], return_counts=True)
    by_rank = dict(zip(ur.tolist(), n.tolist()))
    if by_rank:
        who = ", ".join(f"rank {r}: {c}" for r, c in list(by_rank.items())[:8])
        warnings.append(f"{int(n.sum())} calls in groups closed by ncclGroupSimulateEnd were left out "
                        "(NCCL only estimated their time and launched nothing): "
                        f"{who}{', ...' if len(by_rank) > 8 else ''}")
    for name, a in list(k.items()):
        if a is not None:
            k[name] = a[~sim]
    return by_rank


def _members_and_peers(rank, op, comm, crank, peer_c) -> tuple[dict, np.ndarray]:
    """(comm code -> its sorted global ranks, the global rank at the other end of each
    send/recv or -1), from the calls' communicator ranks."""
    ismem = (op > 0) & (crank >= 0)
    key = comm[ismem] * (1 << 32) + crank[ismem]
    uk, first = np.unique(key, return_index=True)
    gr = rank[ismem][first]
    members: dict = {}
    for c, g in zip((uk >> 32).tolist(), gr.tolist()):
        members.setdefault(c, []).append(g)
    members = {c: sorted(set(v)) for c, v in members.items()}
    peer = np.full(len(rank), -1, np.int64)
    p2p = ((op == _SEND) | (op == _RECV)) & (peer_c >= 0)
    if p2p.any() and len(uk):
        pk = comm[p2p] * (1 << 32) + peer_c[p2p]
        i = np.searchsorted(uk, pk)
        ok = (i < len(uk)) & (uk[np.minimum(i, len(uk) - 1)] == pk)
        pg = np.full(len(pk), -1, np.int64)
        pg[ok] = gr[i[ok]]
        peer[p2p] = pg
    return members, peer


def _instances(rank, op, comm, seq, warnings: list[str]):
    """Collective instances (comm, op, seq): (instance of each call or -1, and per instance
    its comm code, op code and calls)."""
    coll = (op > 0) & (op != _SEND) & (op != _RECV)
    inst = np.full(len(rank), -1, np.int64)
    if not coll.any():
        z = np.zeros(0, np.int64)
        return inst, z, z, z
    # (comm, op, seq) as one integer: comm < 2^20, op < 2^5, seq < 2^38
    sq = seq[coll]
    if sq.min() < 0 or sq.max() >= 1 << 38 or comm.max() >= 1 << 20:
        raise IngeroError("a collective seq or communicator count out of range for the analysis")
    ik = (comm[coll] << 43) | (op[coll].astype(np.int64) << 38) | sq
    u, inv = _codes(ik)
    cnt = np.bincount(inv, minlength=len(u))
    inst[coll] = inv
    inst_comm, inst_op = u >> 43, (u >> 38) & 31
    # one rank calling one instance twice: keep the first call as the instance's
    dup = _dups(inst, rank)
    if dup.any():
        warnings.append(f"{int(dup.sum())} calls repeat a (communicator, seq) already called "
                        "by the same rank; they are counted as calls, not as instances")
        inst[dup] = -1
        cnt = np.bincount(inst[inst >= 0], minlength=len(inst_op))
    return inst, inst_comm, inst_op, cnt


class Coded(NamedTuple):
    """A text column: a code per row (-1: NULL) and the names the codes stand for."""

    codes: np.ndarray
    names: list

    def name(self, i: int):
        return self.names[self.codes[i]] if self.codes[i] >= 0 else None


def _fetch(batches, fills: dict = _FILLS, types: dict = _TYPES) -> dict:
    """The columns of the record `batches` as numpy arrays, each batch copied out as it comes,
    so that DuckDB holds one at a time (memory its allocator frees is only reused by DuckDB,
    and returned to the system ~10 s later): text and ENUM columns ``Coded`` (a handful of
    node, pod and op names), the others with NULLs filled (`fills`, else 0), as numpy's
    `types` (else their own). {} when there are no rows."""
    parts: dict = {}
    names: dict = {}
    for b in batches:
        for name, c in zip(b.schema.names, b.columns):
            if pa.types.is_string(c.type) or pa.types.is_large_string(c.type):
                c = pc.dictionary_encode(c)
            if pa.types.is_dictionary(c.type):
                seen = names.setdefault(name, {})
                code = np.array([seen.setdefault(v, len(seen)) for v in c.dictionary.to_pylist()] + [-1], np.int32)
                a = code[c.indices.fill_null(len(code) - 1).to_numpy()]
            else:
                c = c.fill_null(pa.scalar(fills.get(name, 0), c.type)) if c.null_count else c
                a = c.to_numpy(zero_copy_only=False).astype(types.get(name, c.type.to_pandas_dtype()), copy=True)
            parts.setdefault(name, []).append(a)
        del b
    out = {name: np.concatenate(p) for name, p in parts.items()}
    if not out or not len(next(iter(out.values()))):
        return {}
    return {name: Coded(a, list(names[name])) if name in names else a for name, a in out.items()}


def _call_order(rank: np.ndarray, t: np.ndarray, event_id: np.ndarray) -> np.ndarray:
    """The rows with a rank (>= 0), by (rank, time, event id): one stable sort of (rank,
    time) packed in an int64, event ids ordering the few rows that tie."""
    keep = np.flatnonzero(rank >= 0)
    if not len(keep):
        return keep
    rank, t, event_id = rank[keep], t[keep], event_id[keep]
    t0 = int(t.min())
    tbits = max((int(t.max()) - t0).bit_length(), 1)
    if int(rank.max()).bit_length() + tbits > 62:
        return keep[np.lexsort((event_id, t, rank))]
    k = (rank << tbits) | (t - t0)
    o = np.argsort(k, kind="stable")
    ks = k[o]
    tie = np.flatnonzero(ks[1:] == ks[:-1])
    if len(tie):
        at = np.unique(np.r_[tie, tie + 1])
        sub = o[at]
        o[at] = sub[np.lexsort((event_id[sub], k[sub]))]
    return keep[o]


def _monotonic(rank, t, d) -> tuple[np.ndarray, np.ndarray]:
    """Device rows in device order: a start that the clock conversion put before the one
    of an earlier operation of its rank moves up to it (the end stays)."""
    up = t.copy()
    bounds = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        up[lo:hi] = np.maximum.accumulate(t[lo:hi])
    return up, np.maximum(d - (up - t), 0)


def _stream_codes(strm: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Per device row, its stream as a code (-1: not recorded, a plugin on profiler API v4)."""
    out = np.full(len(known), -1, np.int64)
    if known.any():
        _, out[known] = _codes(strm[known])
    return out


def _launches(rank, pid, comm, grp) -> np.ndarray:
    """Per device row, its kernel launch: a code shared by the rows of one (rank, process,
    communicator, group number) when there are several; -1 for a row on its own."""
    out = np.full(len(rank), -1, np.int64)
    has = np.flatnonzero(grp >= 0)
    if len(has):
        key = np.stack([rank[has], pid[has], comm[has], grp[has]], axis=1)
        _, code, cnt = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        code = code.ravel()
        shared = cnt[code] > 1
        out[has[shared]] = code[shared]
    return out


def simulated_calls(con):
    """For exports that draw the trace's own rows (ingero/perfetto.py): an Arrow table
    (node, event_id, simulated, seq) of the calls `load` leaves out as simulated, and of the
    collectives it numbers otherwise (seq: the number `load` gives); None when there are none.
    The same query and the same steps as `load`, only run when some group was simulated."""
    if not con.execute("SELECT count(*) FROM nccl_events WHERE op = 'GROUP_SIMULATE_END' AND ret = 0").fetchone()[0]:
        return None
    with warnings_.catch_warnings():
        warnings_.simplefilter("ignore", UserWarning)
        tbl = con.execute(f"SELECT * FROM ({_QUERY}) q WHERE grank IS NOT NULL "
                          "ORDER BY grank, t, event_id").to_arrow_table()
    tbl = recover.communicators(con, tbl, OPS, [])
    cols = _fetch(tbl.to_batches())
    if not cols:
        return None
    rank, seq, op = cols["grank"], cols["seq"], _op_codes(cols["op"])
    _, comm = _codes(cols["comm"])
    sim = simulated(rank, op, _simulate_ends(cols["op"], cols["ret"] == 0))
    new = launched_seq(rank, op, comm, seq, sim)
    pick = sim | (new != seq)
    if not pick.any():
        return None
    return pa.table({"node": tbl.column("node").filter(pa.array(pick)),
                     "event_id": tbl.column("event_id").filter(pa.array(pick)),
                     "simulated": pa.array(sim[pick]), "seq": pa.array(new[pick])})


_OP_CODE = {o: i + 1 for i, o in enumerate(OPS)} | {"GROUP_START": _GS, "GROUP_END": _GE, "GROUP_SIMULATE_END": _GE}


def _op_codes(op: Coded) -> np.ndarray:
    """The op code of each row (0: none of the calls read, or NULL).

    ncclGroupSimulateEnd closes a group as ncclGroupEnd does (code -2): without it the rank's
    later calls would all seem to sit in one open group. Whether it launched what the group
    holds is ``simulated``'s question (``_simulate_ends``)."""
    return np.array([_OP_CODE.get(o, 0) for o in op.names] + [0], np.int8)[op.codes]


def _simulate_ends(op: Coded, ret_ok: np.ndarray) -> np.ndarray:
    """Per row: an ncclGroupSimulateEnd that returned ncclSuccess (`ret_ok`)? At the outermost
    level NCCL's ncclGroupEndInternal hands simInfo to groupLaunch, which then skips
    doLaunches, and returns ncclSuccess (0); a non-blocking group instead goes to
    groupLaunchNonBlocking, which launches without simInfo, and the call returns
    ncclInProgress (7) (src/group.cc, 2.22.3 to master)."""
    if "GROUP_SIMULATE_END" not in op.names:
        return np.zeros(len(op.codes), bool)
    return (op.codes == op.names.index("GROUP_SIMULATE_END")) & ret_ok


def _depth(op: np.ndarray, newrank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group depth before, after) each row, per rank: +1 at a start, -1 at an end, never
    below 0 (an end whose start was not traced closes nothing)."""
    step = (op == _GS).astype(np.int64) - (op == _GE)
    after = _clamped_cumsum(step, newrank)
    before = np.r_[0, after[:-1]]
    before[newrank] = 0
    return before, after


def simulated(rank: np.ndarray, op: np.ndarray, sim_end: np.ndarray) -> np.ndarray:
    """The rows (calls, and the group starts and ends around them) of every group whose
    outermost end is `sim_end`: NCCL ran nothing of it. As NCCL counts: only the end that
    brings the depth to 0 launches (or simulates); an ncclGroupSimulateEnd deeper down only
    closes its level (ncclGroupEndInternal returns at ``--ncclGroupDepth > 0`` before it
    looks at simInfo), and the group's calls run or not as its outermost end says."""
    n = len(op)
    if n == 0 or not sim_end.any():
        return np.zeros(n, bool)
    newrank = np.r_[True, rank[1:] != rank[:-1]]
    before, after = _depth(op, newrank)
    outer_start = (op == _GS) & (before == 0)
    outer_end = (op == _GE) & (before == 1) & (after == 0)
    g = np.cumsum(outer_start) - 1                 # the outermost group a row is in
    in_group = ((before > 0) | outer_start) & (g >= 0)
    sim_group = np.zeros(int(outer_start.sum()) + 1, bool)
    sim_group[g[outer_end & sim_end]] = True
    return in_group & sim_group[np.maximum(g, 0)]


def launched_seq(rank: np.ndarray, op: np.ndarray, comm: np.ndarray, seq: np.ndarray,
                 sim: np.ndarray) -> np.ndarray:
    """`seq` with each collective's number counted over launched calls only.

    The agent numbers every collective call of a communicator (bpf/nccl.c), simulated ones
    too; NCCL's own seqNumber only advances at launch (ncclProfilerStartTaskEvents). A rank
    that simulated a group numbers its later calls ahead of peers that did not: take away
    the simulated collectives it called before on the same communicator."""
    coll = (op > 0) & (op != _SEND) & (op != _RECV)
    if not (sim & coll).any():
        return seq
    idx = np.flatnonzero(coll)
    key = rank[idx] * (int(comm.max()) + 1) + comm[idx]
    o = np.argsort(key, kind="stable")             # call order within each (rank, comm)
    k, s = key[o], sim[idx[o]].astype(np.int64)
    cs = np.cumsum(s) - s                          # simulated calls before, over all keys
    first = np.r_[True, k[1:] != k[:-1]]
    before = cs - cs[first][np.cumsum(first) - 1]
    out = seq.copy()
    out[idx[o]] -= before
    return out


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, code of each value): np.unique(return_inverse=True), through a
    hash table (Arrow's dictionary encoding) rather than a sort of every value."""
    enc = pa.array(values).dictionary_encode()
    distinct = enc.dictionary.to_numpy(zero_copy_only=False)
    order = np.argsort(distinct, kind="stable")
    rank_of = np.empty(len(order), np.int64)
    rank_of[order] = np.arange(len(order))
    return distinct[order], rank_of[enc.indices.to_numpy(zero_copy_only=False)]


def _dups(inst: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Calls whose (instance, rank) was already seen earlier in call order."""
    idx = np.flatnonzero(inst >= 0)
    key = inst[idx] * (int(rank.max()) + 1) + rank[idx]
    span = int(key.max()) + 1 if len(key) else 0
    if span <= 4 * len(key) and np.bincount(key, minlength=span).max(initial=0) <= 1:
        return np.zeros(len(inst), bool)               # none: counted, not sorted
    _, first = np.unique(key, return_index=True)
    dup = np.ones(len(idx), bool)
    dup[first] = False
    out = np.zeros(len(inst), bool)
    out[idx[dup]] = True
    return out


def _where_ranks_are(rank: np.ndarray, order: np.ndarray, cols: dict) -> dict:
    """rank -> (node, pod, pid) of its latest call (a restarted rank shows where it called last)."""
    last = np.flatnonzero(np.r_[rank[1:] != rank[:-1], True])
    rows = order[last].tolist()
    return {r: (cols["node"].name(i), cols["pod"].name(i), int(cols["pid"][i]))
            for r, i in zip(rank[last].tolist(), rows)}


@dataclass
class Events:
    """Sync events, sorted by (rank, arrival); ``off[k]``..``off[k+1]`` are rank ``ranks[k]``'s."""

    ranks: np.ndarray          # the ranks, sorted
    off: np.ndarray
    rank: np.ndarray           # per event
    a: np.ndarray              # arrival
    e: np.ndarray              # end
    inst: np.ndarray           # collective instance, or -1
    dep_ptr: np.ndarray        # CSR of p2p dependencies (event ids)
    dep_idx: np.ndarray
    p2p_pairs: int
    unpaired: int
    schedule: object = field(default=None, repr=False)   # replay.Schedule, found by the first replay
    # Streams (device events whose streams the plugin recorded, more than one on a rank):
    # CSR of the events of its rank each event follows (its own work starts at the latest
    # of their ends; none: anchored at its arrival). None: each its rank's previous one.
    prev_ptr: np.ndarray | None = None
    prev_idx: np.ndarray | None = None
    _by_inst: tuple | None = field(default=None, repr=False)

    def by_inst(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the events with an instance, by instance and then event; where each instance's
        begin among them; the instance of each run), found once and kept."""
        if self._by_inst is None:
            o = np.flatnonzero(self.inst >= 0)
            o = o[np.argsort(self.inst[o], kind="stable")]
            k = self.inst[o]
            first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, np.int64)
            self._by_inst = (o, first, k[first])
        return self._by_inst

    def per_inst(self, ufunc, values: np.ndarray, fill: int, size: int | None = None) -> np.ndarray:
        """Per instance (`size` of them: every one by default), `ufunc` (np.maximum or
        np.minimum) over its events' `values` (`fill` for one without events)."""
        o, first, ids = self.by_inst()
        out = np.full(int(self.inst.max()) + 1 if size is None else size, fill, np.int64)
        if len(o):
            out[ids] = ufunc.reduceat(values[o], first)
        return out


def _group_owners(c: Calls) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host calls: (first row of each event, event of each row or -1, instance of each
    event). An event per ungrouped call and per outermost group; a group's calls belong to
    it. An event's instance is its collective call's; the collectives of one group (a
    coalesced launch: FSDP's per-layer all-gathers and reduce-scatters) are joined into one
    instance, on every member: the group end waits for all of them (``_join``)."""
    newrank = np.r_[True, c.rank[1:] != c.rank[:-1]]
    start = (c.op == _GS).astype(np.int64)
    end = (c.op == _GE).astype(np.int64)
    # group depth per rank (the same count `simulated` takes groups by)
    depth_before, depth_after = _depth(c.op, newrank)
    depth_before = np.where(end == 1, depth_after + 1, depth_before)
    outer_start = (start == 1) & (depth_before == 0)
    outer_end = (end == 1) & (depth_after == 0) & (depth_before == 1)
    inside = (depth_before > 0) & (c.op > 0)
    real = c.op > 0
    ev_start = (real & ~inside) | outer_start
    gid = np.cumsum(ev_start) - 1                   # event id of each call (calls before any: -1)
    owner = np.where(real | outer_start | outer_end, gid, -1)
    owner[(c.op == _GE) & ~outer_end] = -1
    owner[(c.op == _GS) & ~outer_start] = -1
    first = np.flatnonzero(ev_start)
    return first, owner, _join(c.inst, owner, c.rank[first])


def _launch_owners(c: Calls, launch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Device rows: (first row of each event, event of each row, instance of each event).
    An event per kernel launch (`launch`, ``Calls.launch``; a row on its own is one), arriving
    with its first row; instances launched together are joined (``_join``)."""
    n = c.n
    first = np.arange(n)
    grouped = np.flatnonzero(launch >= 0)
    if len(grouped):
        lf = np.full(int(launch.max()) + 1, n, np.int64)
        np.minimum.at(lf, launch[grouped], grouped)
        first[grouped] = lf[launch[grouped]]
    ev_start = first == np.arange(n)
    gid = np.cumsum(ev_start) - 1
    owner = gid[first]
    starts = np.flatnonzero(ev_start)
    return starts, owner, _join(c.inst, owner, c.rank[starts])


def _join(inst_of_row: np.ndarray, owner: np.ndarray, ev_rank: np.ndarray) -> np.ndarray:
    """The instance of each event (-1: none), from each row's instance and event (`owner`,
    -1: none; `ev_rank`: each event's rank). Instances that share an event on some rank are
    joined into one, on every rank: each member's event holds them all, so none of them ends
    before every member of every one of them arrived; the smallest instance id stands for
    them. A join that would hold two events of one rank is no launch of one (instance
    numbers misaligned across ranks chain every group into one, which waits for itself):
    its events keep the smallest of their own instances."""
    inst = np.full(len(ev_rank), -1, np.int64)
    coll = np.flatnonzero((inst_of_row >= 0) & (owner >= 0))
    if not len(coll):
        return inst
    ev_of, ins = owner[coll], inst_of_row[coll]
    if (ev_of[1:] > ev_of[:-1]).all():           # one instance per event: none to join
        inst[ev_of] = ins
        return inst
    rep = np.arange(int(ins.max()) + 1)
    while True:                                  # join instances that share an event
        low = np.full(len(ev_rank), np.iinfo(np.int64).max, np.int64)
        reduce_at(np.minimum, low, ev_of, rep[ins])
        new = rep.copy()
        np.minimum.at(new, ins, low[ev_of])
        new = new[new]
        if (new == rep).all():
            break
        rep = new
    inst[ev_of] = rep[ins]
    ev = np.flatnonzero(inst >= 0)
    pairs = inst[ev] * (int(ev_rank.max()) + 1) + ev_rank[ev]
    _, first, count = np.unique(pairs, return_index=True, return_counts=True)
    bad = np.isin(inst, inst[ev[first[count > 1]]])
    if bad.any():
        own = np.full(len(ev_rank), np.iinfo(np.int64).max, np.int64)
        reduce_at(np.minimum, own, ev_of, ins)
        inst[bad] = own[bad]
    return inst


def reduce_at(ufunc, out: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    """``ufunc.at(out, keys, values)`` for np.maximum or np.minimum, through one reduceat of
    the values by key (sorted first unless the keys ascend, as an event's calls do): several
    times faster than ufunc.at."""
    if not len(keys):
        return
    if not (keys[1:] >= keys[:-1]).all():
        o = np.argsort(keys, kind="stable")
        keys, values = keys[o], values[o]
    first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    k = keys[first]
    out[k] = ufunc(out[k], ufunc.reduceat(values, first))


def events(c: Calls, before: P2pCounts | None = None) -> Events:
    """The sync events of `c` and their p2p dependencies. `before`: the sends and receives
    made before `c`'s first call (a window of a session), so that pairs count from the
    session's start."""
    n = c.n
    if n == 0:
        z = np.zeros(0, np.int64)
        return Events(z, np.zeros(1, np.int64), z, z, z, z, np.zeros(1, np.int64), z, 0, 0)
    first_call, owner, inst = _group_owners(c) if c.launch is None else _launch_owners(c, c.launch)
    ne = len(first_call)
    real = c.op > 0
    ev_rank = c.rank[first_call]
    a = c.t[first_call].astype(np.int64)
    has = owner >= 0
    e = np.full(ne, np.iinfo(np.int64).min, np.int64)
    reduce_at(np.maximum, e, owner[has], (c.t + c.d)[has])
    # drop group events that hold no call (an empty group)
    nreal = np.bincount(owner[real & has], minlength=ne)
    live = nreal > 0
    # p2p pairing, in order per (comm, sender, receiver)
    W = int(c.rank.max()) + 2
    sends = np.flatnonzero((c.op == _SEND) & (c.peer >= 0) & has)
    recvs = np.flatnonzero((c.op == _RECV) & (c.peer >= 0) & has)
    sk = (c.comm[sends] * W + c.rank[sends]) * W + c.peer[sends]
    rk = (c.comm[recvs] * W + c.peer[recvs]) * W + c.rank[recvs]
    s_ord, r_ord = _nth(sk), _nth(rk)
    if before is not None:
        s_ord += before.lookup(c, sends, c.rank[sends], c.peer[sends], before.sends)
        r_ord += before.lookup(c, recvs, c.peer[recvs], c.rank[recvs], before.recvs)
    K = int(max(s_ord.max(initial=0), r_ord.max(initial=0))) + 1
    s_full = sk * K + s_ord
    r_full = rk * K + r_ord
    common, si, ri = np.intersect1d(s_full, r_full, assume_unique=True, return_indices=True)
    s_ev, r_ev = owner[sends[si]], owner[recvs[ri]]
    unpaired = len(sends) + len(recvs) - 2 * len(common)
    # recv waits for the send's event to arrive; send waits for the recv only in a rendezvous
    rdv = (c.t + c.d)[sends[si]] >= a[r_ev]
    src = np.concatenate([r_ev, s_ev[rdv]])
    dst = np.concatenate([s_ev, r_ev[rdv]])
    same = src == dst
    src, dst = src[~same], dst[~same]
    # renumber live events
    new_id = np.cumsum(live) - 1
    ok = live[src] & live[dst]
    src, dst = new_id[src[ok]], new_id[dst[ok]]
    ev_rank, a, e, inst = ev_rank[live], a[live], e[live], inst[live]
    o = np.argsort(src, kind="stable")
    src, dst = src[o], dst[o]
    dep_ptr = np.zeros(len(a) + 1, np.int64)
    np.add.at(dep_ptr, src + 1, 1)
    dep_ptr = np.cumsum(dep_ptr)
    ranks, off = np.unique(ev_rank, return_index=True)
    off = np.r_[off, len(ev_rank)].astype(np.int64)
    e = np.maximum(e, a)
    prev = (None, None) if c.stream is None else _stream_order(ev_rank, a, e, c.stream[first_call][live])
    return Events(ranks=ranks, off=off, rank=ev_rank, a=a, e=e, inst=inst, dep_ptr=dep_ptr, dep_idx=dst,
                  p2p_pairs=len(common), unpaired=unpaired, prev_ptr=prev[0], prev_idx=prev[1])


def _stream_order(rank: np.ndarray, a: np.ndarray, e: np.ndarray, stream: np.ndarray):
    """(prev_ptr, prev_idx): the events each event follows, for events sorted by (rank,
    arrival) on streams `stream` (codes, -1: not recorded, one stream of its own per rank);
    (None, None) when no rank has two streams.

    An event follows, of each stream of its rank, the last event that had ended when it
    started (its own stream's previous event whatever the clocks say; a stream's events
    end in order, so "ended by then" is a prefix of each stream's events), unless another
    of those started after it ended (that one followed it: it is already waited for)."""
    n = len(a)
    if n == 0:
        return None, None
    _, lane = np.unique(np.stack([rank, stream], axis=1), axis=0, return_inverse=True)
    lane = lane.ravel()                              # lanes numbered in (rank, stream) order
    nl = int(lane.max()) + 1
    lane_rank = np.zeros(nl, np.int64)
    lane_rank[lane] = rank
    if nl == len(np.unique(rank)):
        return None, None
    o = np.lexsort((np.arange(n), lane))             # each lane's events, in order
    lo_of = np.searchsorted(lane[o], np.arange(nl))  # where each lane's events begin in `o`
    hi_of = np.r_[lo_of[1:], n]
    pos = np.empty(n, np.int64)
    pos[o] = np.arange(n)
    own = pos > lo_of[lane]
    ev_parts, cand_parts = [np.flatnonzero(own)], [o[pos[own] - 1]]     # its stream's previous event
    end_run = e[o].copy()                            # per lane, the latest end so far
    for lo, hi in zip(lo_of.tolist(), hi_of.tolist()):
        end_run[lo:hi] = np.maximum.accumulate(end_run[lo:hi])
    first_lane = np.searchsorted(lane_rank, rank)    # each event's rank's lanes: first_lane + k
    n_lanes = np.searchsorted(lane_rank, rank, side="right") - first_lane
    for k in range(int(n_lanes.max())):
        ev_k = np.flatnonzero((n_lanes > k) & (lane != first_lane + k))
        L = first_lane[ev_k] + k
        lo = lo_of[L]
        # of lane L's events, those before this one, and of them those ended by its start
        n_before = _in_blocks(o, lo, hi_of[L], ev_k, "left") - lo
        n_ended = np.minimum(_in_blocks(end_run, lo, hi_of[L], a[ev_k], "right") - lo, n_before)
        ok = n_ended > 0
        ev_parts.append(ev_k[ok])
        cand_parts.append(o[lo[ok] + n_ended[ok] - 1])
    ev_of, cand = np.concatenate(ev_parts), np.concatenate(cand_parts)
    late = np.full(n, np.iinfo(np.int64).min, np.int64)         # the latest start among them
    np.maximum.at(late, ev_of, a[cand])
    keep = (e[cand] > late[ev_of]) | (a[cand] == late[ev_of])
    ev_of, cand = ev_of[keep], cand[keep]
    srt = np.lexsort((cand, ev_of))
    return np.r_[0, np.cumsum(np.bincount(ev_of, minlength=n))], cand[srt]


def _in_blocks(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, q: np.ndarray,
               side: Literal["left", "right"]) -> np.ndarray:
    """Per query, np.searchsorted of q[i] in v[lo[i]:hi[i]] (each block sorted), as an index of v."""
    out = np.empty(len(q), np.int64)
    blocks, inv = np.unique(lo, return_inverse=True)
    inv = inv.ravel()
    order = np.argsort(inv, kind="stable")
    cut = np.searchsorted(inv[order], np.arange(len(blocks) + 1))
    for b, (l, h) in enumerate(zip(blocks.tolist(), hi[order[cut[:-1]]].tolist())):
        sel = order[cut[b]:cut[b + 1]]
        out[sel] = l + np.searchsorted(v[l:h], q[sel], side=side)
    return out


@dataclass
class P2pCounts:
    """Sends and receives per (communicator hash, sender, receiver) made so far."""

    sends: dict = field(default_factory=dict)
    recvs: dict = field(default_factory=dict)

    def add(self, c: Calls, upto: int) -> None:
        """Count `c`'s sends and receives before time `upto`."""
        sel = (c.t < upto) & (c.peer >= 0)
        for op, src, dst, into in ((_SEND, c.rank, c.peer, self.sends), (_RECV, c.peer, c.rank, self.recvs)):
            k = np.flatnonzero(sel & (c.op == op))
            keys, n = np.unique(_pair_key(c, k, src[k], dst[k]), return_counts=True)
            for key, m in zip(_pair_names(c, keys), n.tolist()):
                into[key] = into.get(key, 0) + m

    @staticmethod
    def lookup(c: Calls, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, counts: dict) -> np.ndarray:
        """Per row of `rows`: the count `counts` holds for its (communicator, src, dst)."""
        if not counts or not len(rows):
            return np.zeros(len(rows), np.int64)
        keys, inv = np.unique(_pair_key(c, rows, src, dst), return_inverse=True)
        return np.array([counts.get(k, 0) for k in _pair_names(c, keys)], np.int64)[inv.ravel()]


_PAIR_BITS = 21          # global ranks below 2^21; communicator codes below 2^20 (`load`)


def _pair_key(c: Calls, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(communicator code, src, dst) of `rows` as one int64."""
    return (c.comm[rows] << (2 * _PAIR_BITS)) | (src << _PAIR_BITS) | dst


def _pair_names(c: Calls, keys: np.ndarray) -> list:
    """The (communicator hash, src, dst) of each `_pair_key`."""
    mask = (1 << _PAIR_BITS) - 1
    comm, src, dst = keys >> (2 * _PAIR_BITS), (keys >> _PAIR_BITS) & mask, keys & mask
    return list(zip(c.comm_hash[comm].tolist(), src.tolist(), dst.tolist()))


def _clamped_cumsum(step: np.ndarray, newrank: np.ndarray) -> np.ndarray:
    """Running sum of `step` restarting at each new rank, never below zero."""
    cs = np.cumsum(step)
    run = cs - np.r_[0, cs][np.flatnonzero(newrank)][np.cumsum(newrank) - 1]
    if (run >= 0).all():                 # nothing to clamp: every end closes a start
        return run
    acc = 0
    for i, (s, nr) in enumerate(zip(step.tolist(), newrank.tolist())):
        acc = max((0 if nr else acc) + s, 0)
        run[i] = acc
    return run


def _nth(keys: np.ndarray) -> np.ndarray:
    """For each key (in call order), how many equal keys came before it."""
    if len(keys) == 0:
        return np.zeros(0, np.int64)
    o = np.argsort(keys, kind="stable")
    ks = keys[o]
    newk = np.r_[True, ks[1:] != ks[:-1]]
    pos = np.arange(len(ks)) - np.maximum.accumulate(np.where(newk, np.arange(len(ks)), 0))
    out = np.empty(len(keys), np.int64)
    out[o] = pos
    return out
