"""numpy views of the event records in bpf/ingero.h.

Each dtype mirrors one C struct field by field, with explicit offsets and
the struct's size, so a whole span of a ring buffer decodes with one
``numpy.frombuffer``. tests/unit/test_records.py compiles the header and
checks every field's offset and size against these; change both together.

A ring buffer record is an 8-byte header (u32 length with the BUSY bit 31
and DISCARD bit 30, u32 page offset) followed by the struct, padded to 8
bytes; ``ringbuf_dtype`` describes header plus record.
"""

from __future__ import annotations

import numpy as np


def _dtype(fields: list[tuple[str, str, int]], size: int) -> np.dtype:
    return np.dtype({
        "names": [f[0] for f in fields],
        "formats": [f[1] for f in fields],
        "offsets": [f[2] for f in fields],
        "itemsize": size,
    })


NCCL_EVENT = _dtype([
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

TCP_EVENT = _dtype([
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

SCHED_EVENT = _dtype([
    ("ts_ns", "<u8", 0),
    ("off_ns", "<u8", 8),
    ("runq_ns", "<u8", 16),
    ("cgroup_id", "<u8", 24),
    ("pid", "<u4", 32),
    ("tid", "<u4", 36),
    ("reason", "u1", 40),
    ("_pad", "(7,)u1", 41),
], 48)

# family name -> (C struct name, dtype, ring buffer map name, lost-counter slot)
FAMILIES: dict[str, tuple[str, np.dtype, str, int]] = {
    "nccl": ("ingero_nccl_event", NCCL_EVENT, "nccl_events", 0),
    "tcp": ("ingero_tcp_event", TCP_EVENT, "tcp_events", 1),
    "sched": ("ingero_sched_event", SCHED_EVENT, "sched_events", 2),
}

# NCCL_F_* flags and OWNER_* values (bpf/ingero.h)
NCCL_F_IN_GROUP = 1
NCCL_F_COMM_UNKNOWN = 2
NCCL_F_BCAST_ALIAS = 4
OWNER_SOURCES = {0: "none", 1: "socket", 2: "current", 3: "address"}

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
