"""MappedRing on a memfd laid out like a BPF ring buffer map (consumer page,
producer page, data pages mapped twice): bulk decode, stop at a busy record,
skip discarded ones, wrap around the end, and publish consumer_pos."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from ingero_agent.records import NCCL_EVENT, RINGBUF_BUSY_BIT, RINGBUF_DISCARD_BIT, SCHED_EVENT
from ingero_agent.ringbuf import PAGE_SIZE, MappedRing

SIZE = PAGE_SIZE  # one data page


class FakeRing:
    """The kernel's side: writes records at producer_pos, both copies of the data."""

    def __init__(self):
        if not hasattr(os, "memfd_create"):
            pytest.skip("os.memfd_create is not available")
        self.fd = os.memfd_create("ring")
        os.ftruncate(self.fd, 2 * PAGE_SIZE + 2 * SIZE)
        self.m = mmap.mmap(self.fd, 2 * PAGE_SIZE + 2 * SIZE)
        self.prod = 0

    def _write_data(self, pos: int, blob: bytes) -> None:
        for i, b in enumerate(blob):
            off = (pos + i) % SIZE
            for copy in (0, SIZE):
                self.m[2 * PAGE_SIZE + copy + off] = b

    def put(self, rec: np.ndarray, flags: int = 0) -> None:
        body = rec.tobytes()
        hdr = np.array([len(body) | flags, 0], dtype="<u4").tobytes()
        self._write_data(self.prod, hdr + body)
        self.prod += (8 + len(body) + 7) & ~7
        self.m[PAGE_SIZE:PAGE_SIZE + 8] = np.uint64(self.prod).tobytes()

    def set_flags(self, pos: int, flags: int, length: int) -> None:
        self._write_data(pos, np.array([length | flags], dtype="<u4").tobytes())

    @property
    def consumer(self) -> int:
        return int(np.frombuffer(self.m[:8], dtype="<u8")[0])

    def set_consumer(self, pos: int) -> None:
        self.m[0:8] = np.uint64(pos).tobytes()


def _recs(n: int, start: int = 0) -> np.ndarray:
    r = np.zeros(n, dtype=SCHED_EVENT)
    r["ts_ns"] = np.arange(start, start + n)
    r["pid"] = 7
    return r


def test_a_span_of_records_decodes_in_one_read_and_advances_the_consumer():
    k = FakeRing()
    ring = MappedRing(k.fd, SIZE, SCHED_EVENT)
    for r in _recs(10):
        k.put(r)
    got = ring.read()
    assert got["ts_ns"].tolist() == list(range(10)) and (got["pid"] == 7).all()
    assert k.consumer == k.prod
    assert len(ring.read()) == 0


def test_reading_stops_at_a_busy_record_and_resumes_there():
    k = FakeRing()
    ring = MappedRing(k.fd, SIZE, SCHED_EVENT)
    recs = _recs(5)
    for r in recs:
        k.put(r)
    busy_at = 3 * 56
    k.set_flags(busy_at, RINGBUF_BUSY_BIT, SCHED_EVENT.itemsize)
    assert ring.read()["ts_ns"].tolist() == [0, 1, 2]
    assert k.consumer == busy_at
    k.set_flags(busy_at, 0, SCHED_EVENT.itemsize)      # committed now
    assert ring.read()["ts_ns"].tolist() == [3, 4]


def test_discarded_records_are_skipped():
    k = FakeRing()
    ring = MappedRing(k.fd, SIZE, SCHED_EVENT)
    recs = _recs(4)
    for i, r in enumerate(recs):
        k.put(r, RINGBUF_DISCARD_BIT if i == 1 else 0)
    assert ring.read()["ts_ns"].tolist() == [0, 2, 3]
    assert k.consumer == k.prod and ring.skipped == 0


def test_records_that_wrap_around_the_end_decode_whole():
    k = FakeRing()
    ring = MappedRing(k.fd, SIZE, NCCL_EVENT)        # stride 112 does not divide 4096
    stride = 8 + NCCL_EVENT.itemsize
    start = (SIZE // stride) * stride - stride        # two records before the end
    k.prod = start
    k.set_consumer(start)
    recs = np.zeros(5, dtype=NCCL_EVENT)
    recs["comm_hash"] = np.arange(5) + 0xABC00
    recs["rank"] = -1
    for r in recs:
        k.put(r)
    got = ring.read()
    assert got["comm_hash"].tolist() == recs["comm_hash"].tolist()
    assert (got["rank"] == -1).all() and k.consumer == k.prod > SIZE


def test_a_ring_size_that_is_not_a_power_of_two_pages_is_refused():
    k = FakeRing()
    with pytest.raises(ValueError):
        MappedRing(k.fd, 3 * PAGE_SIZE, SCHED_EVENT)
