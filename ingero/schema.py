"""The event schema: table names, columns, types and units.

Table and column names follow the field (DESIGN.md, "Tables") so that the
example queries published for the original Ingero tool run unchanged.

Units: every *_ns column is nanoseconds. ``timestamp_ns`` is wall-clock time
(Unix epoch), already corrected for the node's clock offset when one is
known; ``ts_mono_ns`` keeps the node's raw CLOCK_MONOTONIC reading.

In ``nccl_events``, ``rank`` and ``nranks`` are the caller's rank in the
communicator and its size (as NCCL numbers them, so the published queries mean
what they meant); ``global_rank`` is the process's torchrun RANK. In the other
tables ``rank`` is the torchrun RANK of the owning process.

``event_id`` is node-namespaced: the top 16 bits are a stable hash of the node
name (``node_prefix``), the low 48 bits a per-node counter, so ids from
different nodes never collide and ``(node, event_id)`` identifies a row.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass

from ingero.families import RINGS

class Op(enum.IntEnum):
    """NCCL call kinds, as numbered in bpf/ingero.h (OP_*); a code never changes meaning."""
    ALL_REDUCE = 1
    ALL_GATHER = 2
    REDUCE_SCATTER = 3
    BROADCAST = 4
    REDUCE = 5
    SEND = 6
    RECV = 7
    GROUP_START = 8
    GROUP_END = 9
    COMM_INIT_RANK = 10
    COMM_INIT_ALL = 11
    COMM_SPLIT = 12
    COMM_DESTROY = 13
    COMM_ABORT = 14
    COMM_INIT_RANK_CONFIG = 15
    COMM_INIT_RANK_SCALABLE = 16
    COMM_SHRINK = 17
    COMM_GROW = 18
    GROUP_SIMULATE_END = 19
    ALL_TO_ALL = 20
    GATHER = 21
    SCATTER = 22


NCCL_OPS: dict[int, str] = {int(o): o.name for o in Op}
# The functions of nccl.h each kind records (bpf/nccl.c hooks each as nccl_enter_<function>).
NCCL_FUNCTIONS: dict[Op, tuple[str, ...]] = {
    Op.ALL_REDUCE: ("ncclAllReduce",),
    Op.ALL_GATHER: ("ncclAllGather",),
    Op.REDUCE_SCATTER: ("ncclReduceScatter",),
    Op.BROADCAST: ("ncclBroadcast", "ncclBcast"),
    Op.REDUCE: ("ncclReduce",),
    Op.SEND: ("ncclSend",),
    Op.RECV: ("ncclRecv",),
    Op.GROUP_START: ("ncclGroupStart",),
    Op.GROUP_END: ("ncclGroupEnd",),
    Op.COMM_INIT_RANK: ("ncclCommInitRank",),
    Op.COMM_INIT_ALL: ("ncclCommInitAll",),
    Op.COMM_SPLIT: ("ncclCommSplit",),
    Op.COMM_DESTROY: ("ncclCommDestroy",),
    Op.COMM_ABORT: ("ncclCommAbort",),
    Op.COMM_INIT_RANK_CONFIG: ("ncclCommInitRankConfig",),
    Op.COMM_INIT_RANK_SCALABLE: ("ncclCommInitRankScalable",),   # NCCL >= 2.23
    Op.COMM_SHRINK: ("ncclCommShrink",),                         # NCCL >= 2.27
    Op.COMM_GROW: ("ncclCommGrow",),                             # NCCL >= 2.29
    Op.GROUP_SIMULATE_END: ("ncclGroupSimulateEnd",),            # NCCL >= 2.22
    Op.ALL_TO_ALL: ("ncclAlltoAll",),                            # NCCL >= 2.28
    Op.GATHER: ("ncclGather",),                                  # NCCL >= 2.28
    Op.SCATTER: ("ncclScatter",),                                # NCCL >= 2.28
}
# Calls that make a communicator (comms table); those numbered from a parent record it.
COMM_CREATE_OPS = (Op.COMM_INIT_RANK, Op.COMM_INIT_ALL, Op.COMM_SPLIT, Op.COMM_INIT_RANK_CONFIG,
                   Op.COMM_INIT_RANK_SCALABLE, Op.COMM_SHRINK, Op.COMM_GROW)
DERIVED_COMM_OPS = (Op.COMM_SPLIT, Op.COMM_SHRINK, Op.COMM_GROW)
# ncclResult_t codes that count as success (nccl.h): ncclInProgress (7) is the
# normal return of every call on a non-blocking communicator.
NCCL_OK_RETS = (0, 7)
COLLECTIVE_OPS = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "BROADCAST", "REDUCE",
                  "ALL_TO_ALL", "GATHER", "SCATTER")
P2P_OPS = ("SEND", "RECV")
LIFECYCLE_OPS = ("COMM_INIT_RANK", "COMM_INIT_RANK_CONFIG", "COMM_INIT_RANK_SCALABLE",
                 "COMM_INIT_ALL", "COMM_SPLIT", "COMM_SHRINK", "COMM_GROW",
                 "COMM_DESTROY", "COMM_ABORT")

# ncclDataType_t: name and size in bytes (bytes = count x size).
NCCL_DATATYPES: dict[int, tuple[str, int]] = {
    0: ("int8", 1),
    1: ("uint8", 1),
    2: ("int32", 4),
    3: ("uint32", 4),
    4: ("int64", 8),
    5: ("uint64", 8),
    6: ("float16", 2),
    7: ("float32", 4),
    8: ("float64", 8),
    9: ("bfloat16", 2),
    10: ("float8e4m3", 1),
    11: ("float8e5m2", 1),
}

# The function names NCCL's profiler events carry (ncclFuncToString, NCCL 2.30):
# as nccl_events names them; any other name is written in the same style.
NCCL_PROFILER_FUNCS: dict[str, str] = {
    "AllReduce": "ALL_REDUCE", "AllGather": "ALL_GATHER", "ReduceScatter": "REDUCE_SCATTER",
    "Broadcast": "BROADCAST", "Reduce": "REDUCE", "Send": "SEND", "Recv": "RECV",
    "AlltoAll": "ALL_TO_ALL", "Gather": "GATHER", "Scatter": "SCATTER",
}
ROOTED_OPS = ("BROADCAST", "REDUCE", "GATHER", "SCATTER")

# ncclRedOp_t
NCCL_REDOPS: dict[int, str] = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

TCP_EVENTS: dict[int, str] = {
    1: "tcp_retransmit_skb",
    2: "tcp_send_reset",
    3: "tcp_receive_reset",
    4: "inet_sock_set_state",
}

TCP_STATES: dict[int, str] = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
    6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
    11: "CLOSING", 12: "NEW_SYN_RECV",
}

OFFCPU_REASONS: dict[int, str] = {0: "runqueue", 1: "io", 2: "sleep"}

ADDRESS_FAMILIES: dict[int, str] = {2: "AF_INET", 10: "AF_INET6"}


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[tuple[str, str], ...]
    doc: str

    @property
    def column_names(self) -> list[str]:
        return [c for c, _ in self.columns]

    def ddl(self, if_not_exists: bool = True) -> str:
        cols = ",\n  ".join(f'"{c}" {t}' for c, t in self.columns)
        ine = "IF NOT EXISTS " if if_not_exists else ""
        return f"CREATE TABLE {ine}{self.name} (\n  {cols}\n)"


_IDENTITY = (
    ("pid", "INTEGER"),
    ("tid", "INTEGER"),
    ("cgroup_id", "UBIGINT"),
    ("rank", "INTEGER"),
    ("node", "VARCHAR"),
    ("pod", "VARCHAR"),
    ("namespace", "VARCHAR"),
    ("session_id", "VARCHAR"),
)

NCCL_EVENTS = Table(
    "nccl_events",
    (
        ("event_id", "UBIGINT"),
        ("timestamp_ns", "BIGINT"),
        ("duration_ns", "BIGINT"),
        ("op", "VARCHAR"),
        ("nranks", "INTEGER"),
        ("comm_id_hash", "UBIGINT"),
        ("seq", "BIGINT"),
        ("count", "BIGINT"),
        ("bytes", "BIGINT"),
        ("datatype", "VARCHAR"),
        ("reduce_op", "VARCHAR"),
        ("peer", "INTEGER"),
        ("ret", "INTEGER"),
        ("in_group", "BOOLEAN"),
        ("comm", "UBIGINT"),
        ("stream", "UBIGINT"),
        ("parent_hash", "UBIGINT"),
        ("color", "INTEGER"),
        ("split_key", "INTEGER"),
        ("ts_mono_ns", "BIGINT"),
        ("global_rank", "INTEGER"),
    ) + _IDENTITY,
    "One row per NCCL API call (collectives, point-to-point, groups, communicator lifecycle).",
)

NCCL_PROFILER_EVENTS = Table(
    "nccl_profiler_events",
    (
        ("event_id", "UBIGINT"),
        ("timestamp_ns", "BIGINT"),
        ("op", "VARCHAR"),
        ("nranks", "INTEGER"),
        ("nnodes", "INTEGER"),
        ("comm_hash", "UBIGINT"),
        ("comm_name", "VARCHAR"),
        ("seq", "BIGINT"),
        ("count", "BIGINT"),
        ("bytes", "BIGINT"),
        ("datatype", "VARCHAR"),
        ("peer", "INTEGER"),
        ("algo", "VARCHAR"),
        ("proto", "VARCHAR"),
        ("host_duration_ns", "BIGINT"),
        ("device_start_ns", "BIGINT"),
        ("device_end_ns", "BIGINT"),
        ("device_duration_ns", "BIGINT"),
        ("device_start_raw", "UBIGINT"),
        ("device_end_raw", "UBIGINT"),
        ("nchannels", "INTEGER"),
        ("channels", "INTEGER"),
        ("clock_samples", "BIGINT"),
        ("unfinished", "BOOLEAN"),
        ("dropped", "BIGINT"),
        ("profiler_api", "INTEGER"),
        ("ts_mono_ns", "BIGINT"),
        ("global_rank", "INTEGER"),
        ("group_id", "BIGINT"),
        ("stream", "UBIGINT"),
    ) + _IDENTITY,
    "One row per NCCL collective or point-to-point operation as Ingero's NCCL profiler plugin saw it: "
    "timestamp_ns when NCCL launched it on the host, device_start_ns/device_end_ns when the GPU ran it "
    "(wall clock, converted from the GPU timer in the plugin), NCCL's own comm_hash and seq; group_id "
    "the kernel launch it ran in (equal for the operations of one group or coalesced launch on a "
    "communicator: they share one device interval), stream the CUDA stream it was called on.",
)

NCCL_PROXY = Table(
    "nccl_proxy",
    (
        ("event_id", "UBIGINT"),
        ("timestamp_ns", "BIGINT"),
        ("duration_ns", "BIGINT"),
        ("comm_hash", "UBIGINT"),
        ("comm_rank", "INTEGER"),
        ("op", "VARCHAR"),
        ("seq", "BIGINT"),
        ("channel", "INTEGER"),
        ("is_send", "BOOLEAN"),
        ("peer", "INTEGER"),
        ("peer_rank", "INTEGER"),
        ("net", "VARCHAR"),
        ("nic_device", "VARCHAR"),
        ("nic_port", "INTEGER"),
        ("nic_index", "INTEGER"),
        ("bytes", "BIGINT"),
        ("nsteps", "INTEGER"),
        ("steps", "INTEGER"),
        ("send_gpu_wait_ns", "BIGINT"),
        ("send_peer_wait_ns", "BIGINT"),
        ("send_net_wait_ns", "BIGINT"),
        ("recv_net_wait_ns", "BIGINT"),
        ("recv_flush_wait_ns", "BIGINT"),
        ("recv_gpu_wait_ns", "BIGINT"),
        ("lost", "BIGINT"),
    ) + _IDENTITY,
    "One row per NCCL proxy operation (ProxyOp: an operation's transfers with one peer on one channel, "
    "one direction) as Ingero's profiler plugin summarised it over its steps: timestamp_ns when the "
    "proxy started it, the operation (op, seq, comm_hash as in nccl_profiler_events), peer its rank in "
    "the communicator and peer_rank its global rank (NULL: its process was not traced), the NIC its "
    "NetPlugin events named (net ib or socket; nic_device the socket's interface, nic_index the IB "
    "device's index inside the connection's virtual NIC, 0 unless ports are fused; nic_port NULL: not known), bytes moved, and the time its steps spent in each of "
    "NCCL's wait states: for the GPU's data, for the peer's clear-to-send, for the network to send, "
    "for the network's data, for the flush, for the GPU to consume it. lost: summaries of the "
    "process's communicator overwritten before the tracer read them, so far.",
)

TCP_EVENTS_TABLE = Table(
    "tcp_events",
    (
        ("event_id", "UBIGINT"),
        ("timestamp_ns", "BIGINT"),
        ("event", "VARCHAR"),
        ("saddr", "VARCHAR"),
        ("daddr", "VARCHAR"),
        ("sport", "INTEGER"),
        ("dport", "INTEGER"),
        ("family", "VARCHAR"),
        ("state", "VARCHAR"),
        ("old_state", "VARCHAR"),
        ("skaddr", "UBIGINT"),
        ("owner_source", "VARCHAR"),
        ("ts_mono_ns", "BIGINT"),
    ) + _IDENTITY,
    "TCP retransmits, resets and state changes, attributed to the pod/rank that owns the "
    "connection (owner_source says how: socket, current, proc, address, address-ambiguous or none).",
)

SCHED_EVENTS = Table(
    "sched_events",
    (
        ("event_id", "UBIGINT"),
        ("timestamp_ns", "BIGINT"),
        ("duration_ns", "BIGINT"),
        ("runq_ns", "BIGINT"),
        ("reason", "VARCHAR"),
        ("ts_mono_ns", "BIGINT"),
    ) + _IDENTITY,
    "Off-CPU intervals of target threads above the threshold; reason is runqueue, io or sleep.",
)

SCHED_TOTALS = Table(
    "sched_totals",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("pid", "INTEGER"),
        ("rank", "INTEGER"),
        ("reason", "VARCHAR"),
        ("total_ns", "BIGINT"),
        ("intervals", "BIGINT"),
    ),
    "All off-CPU time of target processes by reason, including intervals under the threshold "
    "(summed in the kernel).",
)

RANKS = Table(
    "ranks",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("pid", "INTEGER"),
        ("rank", "INTEGER"),
        ("local_rank", "INTEGER"),
        ("world_size", "INTEGER"),
        ("local_world_size", "INTEGER"),
        ("group_rank", "INTEGER"),
        ("run_id", "VARCHAR"),
        ("master_addr", "VARCHAR"),
        ("master_port", "INTEGER"),
        ("cgroup_id", "UBIGINT"),
        ("cgroup_path", "VARCHAR"),
        ("pod", "VARCHAR"),
        ("namespace", "VARCHAR"),
        ("process", "VARCHAR"),
        ("nccl_lib", "VARCHAR"),
        ("addresses", "VARCHAR"),
        ("first_seen_ns", "BIGINT"),
    ),
    "One row per traced process: torchrun identity, cgroup, pod and the NCCL library it maps.",
)

COMMS = Table(
    "comms",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("pid", "INTEGER"),
        ("comm", "UBIGINT"),
        ("comm_id_hash", "UBIGINT"),
        ("rank", "INTEGER"),
        ("nranks", "INTEGER"),
        ("parent_hash", "UBIGINT"),
        ("color", "INTEGER"),
        ("split_key", "INTEGER"),
        ("op", "VARCHAR"),
        ("timestamp_ns", "BIGINT"),
    ),
    "Communicators seen being created, with rank and size (split children are resolved across ranks).",
)

NCCL_INFLIGHT = Table(
    "nccl_inflight",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("pid", "INTEGER"),
        ("tid", "INTEGER"),
        ("rank", "INTEGER"),
        ("seen_ns", "BIGINT"),
        ("state", "VARCHAR"),
        ("op", "VARCHAR"),
        ("comm_id_hash", "UBIGINT"),
        ("seq", "BIGINT"),
        ("comm_rank", "INTEGER"),
        ("nranks", "INTEGER"),
        ("peer", "INTEGER"),
        ("in_group", "BOOLEAN"),
        ("since_ns", "BIGINT"),
    ),
    "Each thread of a traced NCCL process as the tracer last saw it (every roll and at stop; a "
    "thread that is gone keeps its last row): seen_ns when, state its /proc state letter (R on a "
    "CPU or runnable, S sleeping, D in I/O, T stopped, ...), and, when it was inside a traced NCCL "
    "call then, the call: op, comm_id_hash, seq, comm_rank and nranks, since_ns when it entered. "
    "A call found on the thread's stack instead (it was inside it when the probes attached, so no "
    "probe saw it enter) has only op, with since_ns when it was first seen there, and no "
    "comm_id_hash, seq, comm_rank or nranks. rank is the process's torchrun RANK.",
)

RDMA_COUNTERS = Table(
    "rdma_counters",
    (
        ("event_id", "UBIGINT"),
        ("timestamp_ns", "BIGINT"),
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("device", "VARCHAR"),
        ("port", "INTEGER"),
        ("counter", "VARCHAR"),
        ("delta", "BIGINT"),
        ("interval_ns", "BIGINT"),
    ),
    "How much each RDMA port counter of the node rose in each sampling interval (increases "
    "above zero only): device and port as in /sys/class/infiniband (port 0: the device's own "
    "hw_counters), counter the file's name in counters/ or hw_counters/, delta its increase "
    "(bytes for port_xmit_data and port_rcv_data, which count 4-byte words), interval_ns the "
    "time since the port's previous read, timestamp_ns when it was read.",
)

RDMA_PORTS = Table(
    "rdma_ports",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("device", "VARCHAR"),
        ("port", "INTEGER"),
        ("state", "VARCHAR"),
        ("phys_state", "VARCHAR"),
        ("rate", "VARCHAR"),
        ("link_layer", "VARCHAR"),
        ("saturated", "VARCHAR"),
    ),
    "The node's RDMA ports as first seen in the session (state, phys_state, rate and link_layer "
    "as sysfs shows them), and the counters that were at their maximum at the last read "
    "(comma-separated: IB PortCounters stop there, so their increases are lower bounds).",
)

RDMA_RANKS = Table(
    "rdma_ranks",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("pid", "INTEGER"),
        ("rank", "INTEGER"),
        ("device", "VARCHAR"),
        ("port", "INTEGER"),
        ("source", "VARCHAR"),
    ),
    "The active RDMA ports each traced process may use, and how that was found: NCCL_IB_HCA "
    "(its environment, with NCCL's syntax), uverbs (the RDMA devices it holds open), gpu-pci (the "
    "NICs nearest its GPU in the PCI tree) or cpu-numa (the NICs on the NUMA nodes of its CPUs).",
)

NCCL_DEVICE_INFLIGHT = Table(
    "nccl_device_inflight",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("pid", "INTEGER"),
        ("rank", "INTEGER"),
        ("seen_ns", "BIGINT"),
        ("comm_hash", "UBIGINT"),
        ("comm_rank", "INTEGER"),
        ("nranks", "INTEGER"),
        ("slot", "INTEGER"),
        ("op", "VARCHAR"),
        ("seq", "BIGINT"),
        ("peer", "INTEGER"),
        ("nchannels", "INTEGER"),
        ("channels_started", "INTEGER"),
        ("channels_stopped", "INTEGER"),
        ("launched_ns", "BIGINT"),
        ("enqueued", "BOOLEAN"),
        ("device_start_ns", "BIGINT"),
    ),
    "The operations Ingero's NCCL profiler plugin holds open in each traced process, as the tracer "
    "last read them from the plugin's table (every roll and at stop; a process that is gone keeps "
    "its last rows): NCCL started them and has not finished them. comm_hash, comm_rank, nranks and "
    "seq are NCCL's own (as in nccl_profiler_events); launched_ns when NCCL launched it on the host, "
    "enqueued whether the launch returned, device_start_ns when its first kernel channel started on "
    "the GPU (NULL: not yet), channels_started/channels_stopped of nchannels. One row per "
    "communicator has no op (slot NULL): the process has it, with nothing open. rank is the "
    "process's torchrun RANK.",
)

NODES = Table(
    "nodes",
    (
        ("node", "VARCHAR"),
        ("session_id", "VARCHAR"),
        ("hostname", "VARCHAR"),
        ("kernel", "VARCHAR"),
        ("agent_version", "VARCHAR"),
        ("mono_to_wall_ns", "BIGINT"),
        ("clock_offset_ns", "BIGINT"),
        ("clock_rtt_ns", "BIGINT"),
        *((f"lost_{r}", "BIGINT") for r in RINGS),
        *((f"events_{r}", "BIGINT") for r in RINGS),
        ("started_ns", "BIGINT"),
        ("ended_ns", "BIGINT"),
    ),
    "One row per node and session: clock offsets applied, events and lost events per probe.",
)

SESSIONS = Table(
    "sessions",
    (
        ("session_id", "VARCHAR"),
        ("node", "VARCHAR"),
        ("started_ns", "BIGINT"),
        ("ended_ns", "BIGINT"),
        ("probes", "VARCHAR"),
        ("targets", "VARCHAR"),
        ("status", "VARCHAR"),
    ),
    "One row per node and session: what was traced, when, and how it ended.",
)

TABLES: dict[str, Table] = {
    t.name: t
    for t in (NCCL_EVENTS, NCCL_PROFILER_EVENTS, NCCL_PROXY, TCP_EVENTS_TABLE, SCHED_EVENTS, SCHED_TOTALS, RANKS,
              COMMS, NCCL_INFLIGHT, NCCL_DEVICE_INFLIGHT, RDMA_COUNTERS, RDMA_PORTS, RDMA_RANKS, NODES, SESSIONS)
}
# the probe families' tables, then those the agent fills from NCCL's profiler table and RDMA counters
EVENT_TABLES = tuple(r.table for r in RINGS.values()) + ("nccl_proxy", "rdma_counters")
# Wall-clock columns per table: what a node's clock offset shifts (gather, merge).
CLOCK_COLUMNS: dict[str, tuple[str, ...]] = {
    "nccl_events": ("timestamp_ns",), "tcp_events": ("timestamp_ns",), "sched_events": ("timestamp_ns",),
    "comms": ("timestamp_ns",), "nccl_inflight": ("seen_ns", "since_ns"),
    "nccl_profiler_events": ("timestamp_ns", "device_start_ns", "device_end_ns"),
    "rdma_counters": ("timestamp_ns",),
    "nccl_device_inflight": ("seen_ns", "launched_ns", "device_start_ns"),
    "nccl_proxy": ("timestamp_ns",),
}


def node_prefix(node: str) -> int:
    """The top 16 bits of every event_id recorded on `node`."""
    return (zlib.crc32(node.encode()) & 0xFFFF) << 48


def create_all(con) -> None:
    """Create every table in a DuckDB connection (no-op for those that exist)."""
    for t in TABLES.values():
        con.execute(t.ddl())
