"""numpy views of the event records in bpf/ingero.h.

Each dtype mirrors one C struct field by field, with explicit offsets and
the struct's size, so a whole span of a ring buffer decodes with one
``numpy.frombuffer``; ``RECORDS`` holds them by struct name (a ring's
``struct`` in ingero.families). tests/unit/test_records.py compiles the header
and checks every field's offset and size against these; change both together.

A ring buffer record is an 8-byte header (u32 length with the BUSY bit 31
and DISCARD bit 30, u32 page offset) followed by the struct, padded to 8
bytes; ``ringbuf_dtype`` describes header plus record.
"""

from __future__ import annotations

import numpy as np


RECORDS: dict[str, np.dtype] = {}   # C struct name -> its dtype


def _dtype(struct: str, fields: list[tuple[str, str | np.dtype, int]], size: int) -> np.dtype:
    RECORDS[struct] = np.dtype({
        "names": [f[0] for f in fields],
        "formats": [f[1] for f in fields],
        "offsets": [f[2] for f in fields],
        "itemsize": size,
    })
    return RECORDS[struct]


NCCL_EVENT = _dtype("ingero_nccl_event", [
    ("ts_ns", "<u8", 0),
    ("duration_ns", "<u8", 8),
    ("cgroup_id", "<u8", 16),
    ("comm", "<u8", 24),
    ("comm_hash", "<u8", 32),
    ("count", "<u8", 40),
    ("stream", "<u8", 48),
    ("parent_hash", "<u8", 56),
    ("pid", "<u4", 64),
    ("tid", "<u4", 68),
    ("seq", "<u4", 72),
    ("rank", "<i4", 76),
    ("nranks", "<i4", 80),
    ("peer", "<i4", 84),
    ("ret", "<i4", 88),
    ("color", "<i4", 92),
    ("key", "<i4", 96),
    ("op", "u1", 100),
    ("datatype", "u1", 101),
    ("redop", "u1", 102),
    ("flags", "u1", 103),
], 104)

TCP_EVENT = _dtype("ingero_tcp_event", [
    ("ts_ns", "<u8", 0),
    ("cgroup_id", "<u8", 8),
    ("skaddr", "<u8", 16),
    ("pid", "<u4", 24),
    ("tid", "<u4", 28),
    ("saddr", "(16,)u1", 32),
    ("daddr", "(16,)u1", 48),
    ("sport", "<u2", 64),
    ("dport", "<u2", 66),
    ("family", "<u2", 68),
    ("kind", "u1", 70),
    ("state", "u1", 71),
    ("oldstate", "u1", 72),
    ("owner_src", "u1", 73),
    ("_pad", "(6,)u1", 74),
], 80)

SCHED_EVENT = _dtype("ingero_sched_event", [
    ("ts_ns", "<u8", 0),
    ("off_ns", "<u8", 8),
    ("runq_ns", "<u8", 16),
    ("cgroup_id", "<u8", 24),
    ("pid", "<u4", 32),
    ("tid", "<u4", 36),
    ("reason", "u1", 40),
    ("_pad", "(7,)u1", 41),
], 48)

# The record Ingero's NCCL profiler plugin hands to its USDT probe; the probe
# copies it into NCCL_PROF_EVENT's `op`.
NCCL_PROF_OP = _dtype("ingero_nccl_prof_op", [
    ("size", "<u4", 0),
    ("version", "<u2", 4),
    ("kind", "u1", 6),
    ("api", "u1", 7),
    ("comm_hash", "<u8", 8),
    ("seq", "<u8", 16),
    ("host_start_ns", "<u8", 24),
    ("host_stop_ns", "<u8", 32),
    ("dev_start_ns", "<u8", 40),
    ("dev_stop_ns", "<u8", 48),
    ("dev_start_raw", "<u8", 56),
    ("dev_stop_raw", "<u8", 64),
    ("count", "<u8", 72),
    ("func", "<u8", 80),
    ("datatype", "<u8", 88),
    ("algo", "<u8", 96),
    ("proto", "<u8", 104),
    ("comm_name", "<u8", 112),
    ("dropped", "<u8", 120),
    ("rank", "<i4", 128),
    ("nranks", "<i4", 132),
    ("nnodes", "<i4", 136),
    ("peer", "<i4", 140),
    ("clock_samples", "<u4", 144),
    ("nchannels", "u1", 148),
    ("channels", "u1", 149),
    ("flags", "u1", 150),
    ("_pad", "u1", 151),
    ("group", "<u8", 152),
    ("stream", "<u8", 160),
], 168)

NCCL_PROF_EVENT = _dtype("ingero_nccl_prof_event", [
    ("ts_ns", "<u8", 0),
    ("cgroup_id", "<u8", 8),
    ("pid", "<u4", 16),
    ("tid", "<u4", 20),
    ("func", "S16", 24),
    ("datatype", "S16", 40),
    ("algo", "S16", 56),
    ("proto", "S16", 72),
    ("comm_name", "S32", 88),
    ("op", NCCL_PROF_OP, 120),
], 288)

# The header of the plugin's table of operations (ingero_agent.devinflight reads it live).
NCCL_PROF_TABLE = _dtype("ingero_nccl_prof_table", [
    ("magic", "<u8", 0),
    ("size", "<u4", 8),
    ("version", "<u2", 12),
    ("api", "<u2", 14),
    ("comm_hash", "<u8", 16),
    ("rank", "<i4", 24),
    ("nranks", "<i4", 28),
    ("pid", "<u4", 32),
    ("nslots", "<u4", 36),
    ("slots", "<u4", 40),
    ("stride", "<u4", 44),
    ("off_state", "<u4", 48),
    ("off_started", "<u4", 52),
    ("off_stopped", "<u4", 56),
    ("off_rec", "<u4", 60),
    ("proxy", "<u4", 64),
    ("nproxy", "<u4", 68),
    ("proxy_stride", "<u4", 72),
    ("_pad", "<u4", 76),
    ("proxy_head", "<u8", 80),
    ("proxy_dropped", "<u8", 88),
], 96)
# One ProxyOp's summary in the plugin's ring (the same mapping).
NCCL_PROF_PROXY = _dtype("ingero_nccl_prof_proxy", [
    ("seq", "<u8", 0),
    ("op_seq", "<u8", 8),
    ("func", "<u8", 16),
    ("start_ns", "<u8", 24),
    ("stop_ns", "<u8", 32),
    ("bytes", "<u8", 40),
    ("wait_ns", "(6,)<u8", 48),
    ("peer", "<i4", 96),
    ("nsteps", "<i4", 100),
    ("steps", "<i4", 104),
    ("chunk_size", "<i4", 108),
    ("nic_port", "<i4", 112),
    ("nic_index", "<i4", 116),
    ("is_send", "u1", 120),
    ("channel", "u1", 121),
    ("net", "u1", 122),
    ("_pad", "(5,)u1", 123),
    ("nic_device", "S16", 128),
], 144)
# its wait_ns, in NCCL's proxy step states (bpf/ingero.h NCCL_PROXY_*): the nccl_proxy columns
PROXY_WAITS = ("send_gpu_wait_ns", "send_peer_wait_ns", "send_net_wait_ns", "recv_net_wait_ns",
               "recv_flush_wait_ns", "recv_gpu_wait_ns")
PROXY_NETS = {1: "ib", 2: "socket"}
NCCL_PROF_TABLE_MAGIC = 0x53504f5245474e49
NCCL_PROF_TABLE_NAME = "ingero-nccl-ops"

# NCCL_F_* flags and OWNER_* values (bpf/ingero.h, then the decoder's own)
NCCL_F_IN_GROUP = 1
NCCL_F_COMM_UNKNOWN = 2
NCCL_F_BCAST_ALIAS = 4
NCCL_F_PENDING = 8          # the child handle is not written yet (ncclInProgress)
NCCL_PROF_COLL, NCCL_PROF_P2P = 1, 2   # ingero_nccl_prof_op.kind
NCCL_PROF_F_UNFINISHED = 1
NCCL_PROF_F_STREAM = 2
# 0-2 come from the kernel (OWNER_*); 3-5 are set by the decoder for rows the kernel gave no
# owner (decode.tcp_columns). Codes are stable: append, never renumber.
OWNER_SOURCES = {0: "none", 1: "socket", 2: "current", 3: "address", 4: "proc", 5: "address-ambiguous"}
OWNER_ADDRESS, OWNER_PROC, OWNER_ADDRESS_AMBIGUOUS = 3, 4, 5

RINGBUF_BUSY_BIT = 1 << 31
RINGBUF_DISCARD_BIT = 1 << 30
RINGBUF_HDR_SIZE = 8


def ringbuf_dtype(record: np.dtype) -> np.dtype:
    """Header + record as laid out in a BPF ring buffer (8-byte aligned)."""
    stride = (RINGBUF_HDR_SIZE + record.itemsize + 7) & ~7
    return np.dtype({
        "names": ["len", "pgoff", "rec"],
        "formats": ["<u4", "<u4", record],
        "offsets": [0, 4, RINGBUF_HDR_SIZE],
        "itemsize": stride,
    })
