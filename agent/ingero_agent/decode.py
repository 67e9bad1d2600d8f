"""Turn decoded records into the schema's columns, whole arrays at a time.

Names (op, datatype, event, reason) become dictionary-coded columns
(``store.dict_column``), bytes = count x datatype size, CLOCK_MONOTONIC
times become wall-clock times, and each row gets the rank, pod and namespace
of the process that made it (TCP events: of the socket's owner from the kernel, else of
the target process holding the connection in /proc, else of the target pod whose
address is the connection's local end, when only one pod and rank have it). Python runs
once per distinct pid or connection in a batch, never once per row.
"""

from __future__ import annotations

import ipaddress
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ingero import schema
from ingero.schema import Op
from ingero.store import dict_column
from ingero_agent.records import (NCCL_F_IN_GROUP, NCCL_PROF_F_STREAM, NCCL_PROF_F_UNFINISHED, NCCL_PROF_P2P,
                                  OWNER_ADDRESS, OWNER_ADDRESS_AMBIGUOUS, OWNER_PROC, OWNER_SOURCES)
from ingero_agent.sockowners import SocketOwners, fold_address

_DATA_OPS = np.zeros(256, dtype=bool)
_REDUCE_OPS = np.zeros(256, dtype=bool)
for _code, _name in schema.NCCL_OPS.items():
    _DATA_OPS[_code] = _name in schema.COLLECTIVE_OPS + schema.P2P_OPS
    _REDUCE_OPS[_code] = _name in ("ALL_REDUCE", "REDUCE_SCATTER", "REDUCE")
_DT_SIZE = np.zeros(256, dtype=np.int64)
for _code, (_n, _size) in schema.NCCL_DATATYPES.items():
    _DT_SIZE[_code] = _size
_DT_NAMES = {c: n for c, (n, _) in schema.NCCL_DATATYPES.items()}


Decoder = Callable[[np.ndarray, int, "Registry"], dict]
DECODERS: dict[str, Decoder] = {}   # ring (ingero.families.RINGS) -> its columns from its records


def decodes(ring: str) -> Callable[[Decoder], Decoder]:
    """Register the decoder of `ring`'s records."""
    def register(fn: Decoder) -> Decoder:
        DECODERS[ring] = fn
        return fn
    return register


def mono_to_wall(samples: int = 9) -> tuple[int, int]:
    """(CLOCK_REALTIME - CLOCK_MONOTONIC in ns, uncertainty in ns).

    Reads realtime, monotonic, realtime several times and keeps the pair
    with the tightest bracket; the offset is taken at its middle.
    """
    best = (0, 1 << 62)   # (offset, bracket): any reading is tighter
    for _ in range(max(samples, 1)):
        r1 = time.clock_gettime_ns(time.CLOCK_REALTIME)
        m = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        r2 = time.clock_gettime_ns(time.CLOCK_REALTIME)
        if r2 - r1 < best[1]:
            best = ((r1 + r2) // 2 - m, r2 - r1)
    return best


@dataclass(frozen=True)
class Identity:
    rank: int | None
    pod: str | None
    namespace: str | None


class Registry:
    """pid -> identity; target pod address -> what its owners agree on; and the /proc
    lookup of a connection's holder (`sockets`, None: addresses only), for enrichment."""

    def __init__(self, proc: Path | None = Path("/proc")):
        self.by_pid: dict[int, Identity] = {}
        self.by_ip: dict[str, Identity] = {}
        self.ambiguous_ips: set[str] = set()   # in by_ip, but several pods or ranks have them
        self.sockets = SocketOwners(proc) if proc is not None else None

    def lookup_pid(self, pid: int) -> Identity | None:
        return self.by_pid.get(pid)

    def set_addresses(self, owners: dict[str, list[Identity]]) -> None:
        """Target addresses from their candidate owners (one identity per pod and rank
        with the address; rank None when unknown). An address names a pod only when one
        pod has it (hostNetwork pods share the node's), a rank only when besides that one
        rank does (a pod may run several); otherwise it is ambiguous and those stay None."""
        by_ip, ambiguous = {}, set()
        for ip, idents in owners.items():
            pods = {(i.pod, i.namespace) for i in idents}
            ranks = {i.rank for i in idents if i.rank is not None}
            nss = {i.namespace for i in idents}
            one_pod = len(pods) == 1
            by_ip[ip] = Identity(next(iter(ranks)) if one_pod and len(ranks) == 1 else None,
                                 idents[0].pod if one_pod else None,
                                 next(iter(nss)) if len(nss) == 1 else None)
            if len(pods) > 1 or len(ranks) > 1:
                ambiguous.add(ip)
        self.by_ip, self.ambiguous_ips = by_ip, ambiguous

    def holder(self, pids: tuple[int, ...] | None) -> int | None:
        """The pid that names a connection held by `pids`: the only holder, else the only
        ranked one (a launcher may share a socket with its rank), else the lowest of
        holders that all have one identity; None when they disagree."""
        if not pids:
            return None
        if len(pids) == 1:
            return pids[0]
        idents = {p: self.lookup_pid(p) for p in pids}
        pool = [p for p in pids if (i := idents[p]) is not None and i.rank is not None] or list(pids)
        return pool[0] if len({idents[p] for p in pool}) == 1 else None


def _masked(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.ma.masked_array(values, mask=mask) if mask.any() else values


PID_LUT_MAX = 1 << 22  # the kernel's largest pid_max: a lookup table beats sorting below it


def unique_pids(pids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct pids, index of each row's pid in them), like np.unique(return_inverse)
    but by a lookup table instead of a sort: a drain batch of a million rows holds
    only a handful of pids."""
    pids = np.asarray(pids)
    if len(pids) == 0 or int(pids.max()) >= PID_LUT_MAX or int(pids.min()) < 0:
        return np.unique(pids, return_inverse=True)
    present = np.bincount(pids.astype(np.int64))
    uniq = np.flatnonzero(present)
    lut = np.zeros(len(present), dtype=np.int64)
    lut[uniq] = np.arange(len(uniq))
    return uniq.astype(pids.dtype), lut[pids]


def _identity_columns(pids: np.ndarray, idents: dict[int, Identity | None],
                      codes: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """rank, pod, namespace columns for rows whose process identity is `idents[pid]`."""
    uniq, inv = codes if codes is not None else unique_pids(pids)
    ranks = np.full(len(uniq), -1, dtype=np.int32)
    pods: list[str | None] = []
    nss: list[str | None] = []
    for i, pid in enumerate(uniq.tolist()):
        ident = idents.get(pid)
        if ident and ident.rank is not None:
            ranks[i] = ident.rank
        pods.append(ident.pod if ident else None)
        nss.append(ident.namespace if ident else None)
    rank = ranks[inv]
    return {
        "rank": _masked(rank, rank < 0),
        "pod": dict_column(inv, pods),
        "namespace": dict_column(inv, nss),
    }


@decodes("nccl")
def nccl_columns(a: np.ndarray, offset_ns: int, reg: Registry) -> dict:
    op = a["op"].astype(np.int64)
    data_op = _DATA_OPS[op]
    split = op == Op.COMM_SPLIT
    derived = np.isin(op, schema.DERIVED_COMM_OPS)                # have a parent
    grow_of = (op == Op.COMM_GROW) & (a["parent_hash"] != 0)      # an existing rank's grow
    count = a["count"].astype(np.int64)
    nbytes = count * _DT_SIZE[a["datatype"]]
    codes = unique_pids(a["pid"])
    ident = _identity_columns(a["pid"], {p: reg.lookup_pid(p) for p in codes[0].tolist()}, codes)
    return {
        "timestamp_ns": a["ts_ns"].astype(np.int64) + offset_ns,
        "ts_mono_ns": a["ts_ns"].astype(np.int64),
        "duration_ns": a["duration_ns"].astype(np.int64),
        "op": dict_column(op, schema.NCCL_OPS),
        "rank": a["rank"],                      # rank in the communicator; -1 unknown
        "global_rank": ident["rank"],           # the process's torchrun RANK
        "nranks": a["nranks"],
        "comm_id_hash": a["comm_hash"],
        "seq": _masked(a["seq"].astype(np.int64), ~data_op),
        "count": _masked(count, ~data_op & (op != Op.COMM_INIT_ALL)),
        "bytes": _masked(nbytes, ~data_op),
        "datatype": dict_column(np.where(data_op, a["datatype"], -1), _DT_NAMES),
        "reduce_op": dict_column(np.where(_REDUCE_OPS[op], a["redop"], -1), schema.NCCL_REDOPS),
        "peer": _masked(a["peer"], a["peer"] < 0),   # SEND/RECV peer, BROADCAST/REDUCE root
        "ret": a["ret"],
        "in_group": (a["flags"] & NCCL_F_IN_GROUP) != 0,
        "comm": a["comm"],
        "stream": _masked(a["stream"], ~data_op),
        "parent_hash": _masked(a["parent_hash"], ~derived | ((op == Op.COMM_GROW) & ~grow_of)),
        "color": _masked(a["color"], ~(split | grow_of)),   # COMM_GROW: the parent's grow number
        "split_key": _masked(a["key"], ~split),
        "pid": a["pid"].astype(np.int32),
        "tid": a["tid"].astype(np.int32),
        "cgroup_id": a["cgroup_id"],
        "pod": ident["pod"],
        "namespace": ident["namespace"],
    }


def _strings(raw: np.ndarray, name=lambda s: s or None) -> tuple[np.ndarray, list[str | None]]:
    """(codes, names) of a column of fixed-size C strings, each distinct one decoded once
    and passed through `name` ('' -> None by default)."""
    uniq, inv = np.unique(raw, return_inverse=True)
    return inv.reshape(-1), [name(u.decode(errors="replace")) for u in uniq.tolist()]


def op_name(func: str) -> str | None:
    """NCCL's function name as nccl_events names ops: AllReduce (the profiler's) or
    ncclAllReduce (the API's) -> ALL_REDUCE; ncclBcast, the old name of ncclBroadcast, too."""
    func = "Broadcast" if func == "ncclBcast" else func.removeprefix("nccl")
    if not func:
        return None
    return schema.NCCL_PROFILER_FUNCS.get(func) or re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", func).upper()


def _dtype_name(name: str) -> str | None:
    """ncclFloat32 -> float32, as nccl_events names datatypes."""
    return (name[4:].lower() if name.startswith("nccl") else name.lower()) or None


_DT_BY_NAME = {n: size for n, size in schema.NCCL_DATATYPES.values()}
U64_MAX = np.uint64(2**64 - 1)


@decodes("nccl_profiler")
def nccl_profiler_columns(a: np.ndarray, offset_ns: int, reg: Registry) -> dict:
    o = a["op"]
    op_codes, op_names = _strings(a["func"], op_name)
    dt_codes, dt_names = _strings(a["datatype"], _dtype_name)
    size = np.array([_DT_BY_NAME.get(n, 0) if n else 0 for n in dt_names], dtype=np.int64)[dt_codes]
    count = o["count"].astype(np.int64)
    p2p = o["kind"] == NCCL_PROF_P2P
    rooted = np.array([n in schema.ROOTED_OPS for n in op_names], dtype=bool)[op_codes]
    host0, host1 = o["host_start_ns"].astype(np.int64), o["host_stop_ns"].astype(np.int64)
    d0, d1 = o["dev_start_ns"].astype(np.int64), o["dev_stop_ns"].astype(np.int64)
    r0, r1 = o["dev_start_raw"], o["dev_stop_raw"]
    both = (r0 != 0) & (r1 != 0)
    codes = unique_pids(a["pid"])
    ident = _identity_columns(a["pid"], {p: reg.lookup_pid(p) for p in codes[0].tolist()}, codes)
    return {
        "timestamp_ns": host0 + offset_ns,
        "ts_mono_ns": host0,
        "op": dict_column(op_codes, op_names),
        "rank": o["rank"],                      # rank in the communicator
        "global_rank": ident["rank"],           # the process's torchrun RANK
        "nranks": o["nranks"],
        "nnodes": o["nnodes"],
        "comm_hash": o["comm_hash"],
        "comm_name": dict_column(*_strings(a["comm_name"])),
        "seq": _masked(o["seq"].astype(np.int64), o["seq"] == U64_MAX),
        "count": count,
        "bytes": _masked(count * size, size == 0),
        "datatype": dict_column(dt_codes, dt_names),
        "peer": _masked(o["peer"], ~(p2p | rooted)),   # p2p peer, BROADCAST/REDUCE/... root
        "algo": dict_column(*_strings(a["algo"])),
        "proto": dict_column(*_strings(a["proto"])),
        "host_duration_ns": _masked(host1 - host0, host1 == 0),
        "device_start_ns": _masked(d0 + offset_ns, d0 == 0),
        "device_end_ns": _masked(d1 + offset_ns, d1 == 0),
        "device_duration_ns": _masked((r1 - r0).astype(np.int64), ~both | (r1 < r0)),
        "device_start_raw": _masked(r0, r0 == 0),
        "device_end_raw": _masked(r1, r1 == 0),
        "nchannels": o["nchannels"].astype(np.int32),
        "channels": o["channels"].astype(np.int32),
        "clock_samples": o["clock_samples"].astype(np.int64),
        "unfinished": (o["flags"] & NCCL_PROF_F_UNFINISHED) != 0,
        "dropped": o["dropped"].astype(np.int64),
        "profiler_api": o["api"].astype(np.int32),
        "group_id": _masked(o["group"].astype(np.int64), o["group"] == 0),
        "stream": _masked(o["stream"], (o["flags"] & NCCL_PROF_F_STREAM) == 0),
        "pid": a["pid"].astype(np.int32),
        "tid": a["tid"].astype(np.int32),
        "cgroup_id": a["cgroup_id"],
        "pod": ident["pod"],
        "namespace": ident["namespace"],
    }


def format_addresses(addr: np.ndarray, family: np.ndarray) -> tuple[np.ndarray, list[str | None]]:
    """(codes, names) of the addresses in rows of 16 bytes, formatted once per distinct one."""
    keyed = np.concatenate([addr, family.astype(np.uint8)[:, None]], axis=1)
    uniq, inv = np.unique(keyed, axis=0, return_inverse=True)
    names: list[str | None] = []
    for row in uniq:
        fam = int(row[16])
        if fam == 2:
            names.append(str(ipaddress.IPv4Address(bytes(row[:4]))))
        elif fam == 10:
            names.append(str(ipaddress.IPv6Address(bytes(row[:16]))))
        else:
            names.append(None)
    return inv.reshape(-1), names


def _unmapped(name: str | None) -> str | None:
    """An IPv4-mapped IPv6 address (::ffff:a.b.c.d, a dual-stack socket talking IPv4)
    as the IPv4 address pods are listed with; any other address unchanged."""
    if name and name.startswith("::ffff:"):
        mapped = ipaddress.IPv6Address(name).ipv4_mapped
        if mapped is not None:
            return str(mapped)
    return name


def _groups(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row of each distinct key, key number of each row) for rows keyed by several
    integer columns: np.unique(axis=0) would sort them as bytes, several times slower."""
    order = np.lexsort(cols[::-1])
    new = np.zeros(len(order), dtype=bool)
    new[:1] = True
    for c in cols:
        c = c[order]
        new[1:] |= c[1:] != c[:-1]
    inv = np.empty(len(order), dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return order[new], inv


@decodes("tcp")
def tcp_columns(a: np.ndarray, offset_ns: int, reg: Registry) -> dict:
    s_codes, s_names = format_addresses(a["saddr"], a["family"])
    d_codes, d_names = format_addresses(a["daddr"], a["family"])
    pid = a["pid"]
    owner = a["owner_src"].astype(np.int64)
    out_pid = pid.astype(np.int64)
    keys = out_pid.copy()
    idents: dict[int, Identity | None] = {}
    unknown = np.flatnonzero(pid == 0)
    if len(unknown):
        # Rows without an owner from the kernel, once per distinct connection: the target
        # process holding it (/proc), else the target pod whose address is the local end.
        first, inv = _groups(a["skaddr"][unknown], s_codes[unknown], d_codes[unknown],
                             a["sport"][unknown], a["dport"][unknown])
        rows = unknown[first].tolist()
        fam = a["family"]
        conns = [(int(a["skaddr"][i]), (fold_address(a["saddr"][i].tobytes(), int(fam[i])), int(a["sport"][i]),
                                        fold_address(a["daddr"][i].tobytes(), int(fam[i])), int(a["dport"][i])))
                 for i in rows]
        held = reg.sockets.resolve(conns, reg.by_pid.keys()) if reg.sockets and reg.by_pid else {}
        src = np.zeros(len(rows), dtype=np.int64)
        by_proc = np.zeros(len(rows), dtype=np.int64)
        for j, (i, c) in enumerate(zip(rows, conns)):
            p = reg.holder(held.get(c))
            if p is not None:
                idents[-1 - j], src[j], by_proc[j] = reg.lookup_pid(p), OWNER_PROC, p
                continue
            ip = _unmapped(s_names[s_codes[i]])
            idents[-1 - j] = by_addr = reg.by_ip.get(ip) if ip is not None else None
            if by_addr is not None:
                src[j] = OWNER_ADDRESS_AMBIGUOUS if ip in reg.ambiguous_ips else OWNER_ADDRESS
        # a synthetic key per connection, so one lookup table serves all rows
        keys[unknown] = -1 - inv
        owner[unknown] = np.where(src[inv] > 0, src[inv], owner[unknown])
        out_pid[unknown] = by_proc[inv]   # the holder's pid; its thread is not known
    for p in np.unique(pid[pid != 0]).tolist():
        idents[p] = reg.lookup_pid(p)
    ident = _identity_columns(keys, idents)
    state_ev = a["kind"] == 4
    return {
        "timestamp_ns": a["ts_ns"].astype(np.int64) + offset_ns,
        "ts_mono_ns": a["ts_ns"].astype(np.int64),
        "event": dict_column(a["kind"], schema.TCP_EVENTS),
        "saddr": dict_column(s_codes, s_names),
        "daddr": dict_column(d_codes, d_names),
        "sport": a["sport"].astype(np.int32),
        "dport": a["dport"].astype(np.int32),
        "family": dict_column(a["family"], schema.ADDRESS_FAMILIES),
        "state": dict_column(np.where(a["state"] > 0, a["state"], -1), schema.TCP_STATES),
        "old_state": dict_column(np.where(state_ev, a["oldstate"], -1), schema.TCP_STATES),
        "skaddr": a["skaddr"],
        "owner_source": dict_column(owner, OWNER_SOURCES),
        "pid": _masked(out_pid.astype(np.int32), out_pid == 0),
        "tid": _masked(a["tid"].astype(np.int32), pid == 0),
        "cgroup_id": _masked(a["cgroup_id"], a["cgroup_id"] == 0),
        **ident,
    }


@decodes("sched")
def sched_columns(a: np.ndarray, offset_ns: int, reg: Registry) -> dict:
    codes = unique_pids(a["pid"])
    ident = _identity_columns(a["pid"], {p: reg.lookup_pid(p) for p in codes[0].tolist()}, codes)
    return {
        "timestamp_ns": a["ts_ns"].astype(np.int64) + offset_ns,
        "ts_mono_ns": a["ts_ns"].astype(np.int64),
        "duration_ns": a["off_ns"].astype(np.int64),
        "runq_ns": a["runq_ns"].astype(np.int64),
        "reason": dict_column(a["reason"], schema.OFFCPU_REASONS),
        "pid": a["pid"].astype(np.int32),
        "tid": a["tid"].astype(np.int32),
        "cgroup_id": a["cgroup_id"],
        **ident,
    }

