"""Bulk drain of BPF ring buffers: one numpy decode per poll, not per event.

Every record of a probe family has the same size, so the span between the
consumer and producer positions is an array of (8-byte header, record)
pairs. ``MappedRing`` maps the ring buffer the way the kernel lays it out
for user space:

    offset 0          one page, read-write: consumer_pos (u64)
    offset page_size  one page, read-only: producer_pos (u64), then the data
                      pages, mapped twice in a row so a span that wraps around
                      the end is still contiguous

A record header is a u32 length (bit 31 BUSY: still being written; bit 30
DISCARD: skip it) and a u32 page offset; records are 8-byte aligned. A poll
reads producer_pos, decodes every complete record up to the first busy one
in a single ``frombuffer`` view, copies them out, and only then publishes the
new consumer_pos, so the kernel never overwrites a record being read.

x86-64 keeps loads and stores in program order relative to each other
(TSO), which is what the kernel's smp_load_acquire/smp_store_release pair
needs here; the agent's NCCL probes are x86-64-only for the same reason.

``CallbackRing`` is the fallback when the map cannot be mapped: bcc's
``open_ring_buffer`` with a callback that only appends the raw bytes.

``RingWaiter`` sleeps in epoll on mapped rings (edge-triggered): the probes
write with BPF_RB_NO_WAKEUP until a ring passes its watermark (bpf/ingero.h,
``ingero_ring_flags``), so the agent sleeps through quiet periods and wakes
for bursts; ``notify()`` (e.g. from a signal handler) ends a wait early.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select

import numpy as np

from ingero_agent.records import (RINGBUF_BUSY_BIT, RINGBUF_DISCARD_BIT, RINGBUF_HDR_SIZE,
                                  ringbuf_dtype)

PAGE_SIZE = mmap.PAGESIZE


class MappedRing:
    """Reads fixed-size records straight from a ring buffer map's memory."""

    def __init__(self, map_fd: int, size: int, record: np.dtype):
        if size <= 0 or size & (size - 1) or size % PAGE_SIZE:
            raise ValueError(f"ring buffer size {size} is not a power-of-2 multiple of the page size")
        self.record = record
        self.size = size
        self._mask = size - 1
        self._pair = ringbuf_dtype(record)
        self._stride = self._pair.itemsize
        self._cons_map = mmap.mmap(map_fd, PAGE_SIZE, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._data_map = mmap.mmap(map_fd, PAGE_SIZE + 2 * size, mmap.MAP_SHARED,
                                   mmap.PROT_READ, offset=PAGE_SIZE)
        self.fd = map_fd
        self._cons = np.frombuffer(self._cons_map, dtype=np.uint64, count=1)
        self._prod = np.frombuffer(self._data_map, dtype=np.uint64, count=1)
        self._data = np.frombuffer(self._data_map, dtype=np.uint8, offset=PAGE_SIZE)
        self.skipped = 0   # records of an unexpected size (never produced by our probes)

    def pending_bytes(self) -> int:
        return int(self._prod[0]) - int(self._cons[0])

    def read(self) -> np.ndarray:
        """Every complete record available now, as a copied structured array."""
        cons = int(self._cons[0])
        prod = int(self._prod[0])
        out = []
        while cons < prod:
            start = cons & self._mask
            avail = prod - cons
            n = avail // self._stride
            if n:
                pairs = self._data[start:start + n * self._stride].view(self._pair)
                lens = pairs["len"]
                good = lens == self.record.itemsize
                k = n if good.all() else int(np.argmin(good))
                if k:
                    out.append(pairs["rec"][:k].copy())
                    cons += k * self._stride
                    if k == n and cons == prod:
                        break
            # A record that is not a plain complete one of our size.
            hdr = int(self._data[cons & self._mask:(cons & self._mask) + 4].view("<u4")[0])
            if hdr & RINGBUF_BUSY_BIT:
                break
            length = hdr & ~(RINGBUF_BUSY_BIT | RINGBUF_DISCARD_BIT)
            if not hdr & RINGBUF_DISCARD_BIT and length != self.record.itemsize:
                self.skipped += 1
            cons += (RINGBUF_HDR_SIZE + length + 7) & ~7
        self._cons[0] = cons
        if not out:
            return np.empty(0, dtype=self.record)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def close(self) -> None:
        self._cons = self._prod = self._data = None
        for m in (self._cons_map, self._data_map):
            try:
                m.close()
            except BufferError:
                pass  # a view still exists; the mapping goes with the process


class CallbackRing:
    """Fallback: bcc's ring buffer callback, appending raw bytes for a bulk decode."""

    def __init__(self, bpf, table_name: str, record: np.dtype):
        self.record = record
        self.skipped = 0
        self._bpf = bpf
        self._chunks: list[bytes] = []
        chunks = self._chunks

        def _append(_ctx, data, size):
            chunks.append(ctypes.string_at(data, size))
            return 0

        bpf[table_name.encode()].open_ring_buffer(_append)

    def read(self) -> np.ndarray:
        self._bpf.ring_buffer_consume()
        if not self._chunks:
            return np.empty(0, dtype=self.record)
        size = self.record.itemsize
        good = [c for c in self._chunks if len(c) == size]
        self.skipped += len(self._chunks) - len(good)
        self._chunks.clear()
        return np.frombuffer(b"".join(good), dtype=self.record).copy()

    def close(self) -> None:
        pass


class RingWaiter:
    """Waits until a ring buffer wakes its reader, `notify()` is called, or a timeout."""

    def __init__(self, rings=()):
        self._ep = select.epoll()
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._r, select.EPOLLIN)
        for ring in rings:
            self.add(ring)

    def add(self, ring: MappedRing) -> None:
        # Edge-triggered: a ring that still holds records is reported once,
        # not on every wait; only the kernel's wake-ups report it again.
        self._ep.register(ring.fd, select.EPOLLIN | select.EPOLLET)

    def notify(self) -> None:
        """End the current (or next) wait; safe in a signal handler."""
        try:
            os.write(self._w, b"x")
        except OSError:
            pass   # the pipe is full: a wait will end anyway

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`; True when a ring (or notify) ended the wait."""
        got = self._ep.poll(max(0.0, timeout_s))
        for fd, _ in got:
            if fd == self._r:
                try:
                    while os.read(self._r, 64):
                        pass
                except OSError:
                    pass
        return bool(got)

    def close(self) -> None:
        self._ep.close()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def open_ring(bpf, table_name: str, size: int, record: np.dtype, force_callback: bool = False):
    """A bulk reader for ring buffer map `table_name` of a loaded bcc module."""
    if not force_callback:
        try:
            return MappedRing(bpf[table_name.encode()].map_fd, size, record)
        except (OSError, ValueError, AttributeError):
            pass
    return CallbackRing(bpf, table_name, record)
