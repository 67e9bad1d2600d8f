"""NCCL operations in flight on the device, read from Ingero's profiler plugin.

On a GPU the host only queues a collective and then waits in the stream's
synchronisation, outside NCCL: a collective stuck on the device leaves no NCCL
call in flight (ingero_agent.inflight), and the plugin records an operation
only when it finishes. But the plugin keeps every open operation in a slot of a
per-communicator table in shared memory (bpf/ingero.h: struct
ingero_nccl_prof_table, a mapping named "/memfd:ingero-nccl-ops" in
/proc/<pid>/maps), its record filled from the start and its device start from
its first kernel channel. So at each roll the tracer reads those mappings
through /proc/<pid>/mem (one read per communicator, no probe, nothing in the
training process) and writes what is open: `nccl_device_inflight`, one row per
open operation and one per communicator with nothing open. The tables exist
from the communicator's init, so a collective that was stuck before the
tracer attached is seen too.

A slot may be read while the plugin writes it: a record whose size or version
is not the plugin's is skipped (the next roll reads it whole).

The same mapping holds the plugin's ring of proxy summaries (one per ProxyOp:
an operation's transfers with one peer on one channel, with the time its steps
waited in each of NCCL's states); each read takes the entries written since the
last one (`nccl_proxy` rows). Entries overwritten before they were read are
counted (`lost`); one still being written is read next time.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ingero_agent.decode import op_name
from ingero_agent.procinfo import parse_map_ranges
from ingero_agent.records import (NCCL_PROF_OP, NCCL_PROF_PROXY, NCCL_PROF_TABLE, NCCL_PROF_TABLE_MAGIC,
                                  NCCL_PROF_TABLE_NAME, PROXY_NETS, PROXY_WAITS)

VERSION = 2                     # bpf/ingero.h: INGERO_NCCL_PROF_VERSION
SLOT_OPEN = 1
NO_SEQ = (1 << 64) - 1          # a p2p op whose peer was out of range
_MAPPING = f" /memfd:{NCCL_PROF_TABLE_NAME}".encode()   # a maps line's path, after the spaces


class _Gone(Exception):
    """The process's memory reads short: it is exiting."""


def _read_all(fd: int, size: int, at: int) -> bytes:
    """`size` bytes of the process's memory at `at`; _Gone when they cannot all be read."""
    try:
        data = os.pread(fd, size, at)
    except OSError:
        raise _Gone from None
    if len(data) != size:
        raise _Gone
    return data


def _slot_dtype(h) -> np.dtype:
    return np.dtype({"names": ["state", "started", "stopped", "rec"],
                     "formats": ["<u4", "<i4", "<i4", NCCL_PROF_OP],
                     "offsets": [int(h["off_state"]), int(h["off_started"]), int(h["off_stopped"]),
                                 int(h["off_rec"])],
                     "itemsize": int(h["stride"])})


class Reader:
    """Reads the plugin's tables of traced processes; remembers the strings it read."""

    def __init__(self, proc: Path = Path("/proc")):
        self.proc = proc
        self._names: dict[tuple[int, int], str | None] = {}    # (pid, address) -> op name
        self._drained: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, comm_hash) -> (read up to, lost)

    def tables(self, pid: int) -> list[tuple[int, int]]:
        """(start, length) of each of the plugin's table mappings in `pid` (only their lines of
        /proc/<pid>/maps are parsed: a PyTorch process maps thousands of files)."""
        try:
            with open(f"{self.proc}/{pid}/maps", "rb") as f:
                text = f.read()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            if _MAPPING in line:
                m = parse_map_ranges(line.decode(errors="replace"))[0]
                out.append((m.start, m.end - m.start))
        return out

    def read(self, pid: int) -> list[dict] | None:
        """Each table of `pid`: {comm_hash, rank, nranks, ops: open slots' records, proxies,
        partial}; None when the process cannot be read. One that exits while read gives the
        tables read before, `partial`: their proxy summaries count, their open operations
        are a part of its own and do not."""
        maps = self.tables(pid)
        if not maps:
            return []
        try:
            fd = os.open(f"{self.proc}/{pid}/mem", os.O_RDONLY)
        except OSError:
            return None
        out: list[dict] = []
        try:
            for start, length in maps:
                if (t := self._table(fd, pid, start, length)) is not None:
                    out.append(t)
        except _Gone:
            return [{**t, "partial": True} for t in out]
        finally:
            os.close(fd)
        return out

    def _table(self, fd: int, pid: int, start: int, length: int) -> dict | None:
        h = np.frombuffer(_read_all(fd, NCCL_PROF_TABLE.itemsize, start), NCCL_PROF_TABLE)[0]
        end = int(h["slots"]) + int(h["nslots"]) * int(h["stride"])
        if (int(h["magic"]) != NCCL_PROF_TABLE_MAGIC or int(h["size"]) != NCCL_PROF_TABLE.itemsize
                or int(h["version"]) != VERSION or int(h["pid"]) != pid or end > length
                or int(h["stride"]) < int(h["off_rec"]) + NCCL_PROF_OP.itemsize):
            return None     # finalized, another layout, or a forked child's copy of its parent's
        data = _read_all(fd, end, start)
        slots = np.frombuffer(data, _slot_dtype(h), count=int(h["nslots"]), offset=int(h["slots"]))
        rec = slots["rec"]
        live = ((slots["state"] == SLOT_OPEN) & (rec["size"] == NCCL_PROF_OP.itemsize)
                & (rec["version"] == VERSION) & (rec["comm_hash"] == h["comm_hash"]))
        ops = [{"slot": int(i), "started": int(s["started"]), "stopped": int(s["stopped"]), "rec": s["rec"],
                "op": self._name(fd, pid, int(s["rec"]["func"]))} for i, s in zip(np.flatnonzero(live), slots[live])]
        proxies, lost = self._drain(fd, pid, start, h)
        return {"comm_hash": int(h["comm_hash"]), "rank": int(h["rank"]), "nranks": int(h["nranks"]), "ops": ops,
                "proxies": proxies, "proxy_lost": lost}

    def _drain(self, fd: int, pid: int, start: int, h) -> tuple[list[dict], int]:
        """The proxy summaries written since the last read of this table, and how many were lost."""
        n, stride = int(h["nproxy"]), int(h["proxy_stride"])
        key = (pid, int(h["comm_hash"]))
        done, lost = self._drained.get(key, (0, 0))
        head = int(h["proxy_head"])
        if not n or stride != NCCL_PROF_PROXY.itemsize or head <= done:
            return [], lost
        if head - done > n:
            lost += head - done - n
            done = head - n
        out = []
        first = done + 1
        while first <= head:        # entries first..head, in at most two runs (the ring wraps)
            at = (first - 1) % n
            count = min(head - first + 1, n - at)
            try:
                raw = os.pread(fd, count * stride, start + int(h["proxy"]) + at * stride)
            except OSError:
                break
            got = np.frombuffer(raw, NCCL_PROF_PROXY, count=len(raw) // stride)
            if not len(got):        # the process is gone (its memory reads empty): nothing to read
                break
            want = np.arange(first, first + len(got), dtype=np.uint64)
            ok = got["seq"] == want
            if not ok.all():        # one being written: stop before it; overwritten ones: lost
                bad = int(np.argmin(ok))
                writing = got["seq"][bad] < want[bad]
                lost += 0 if writing else int((got["seq"][bad:] > want[bad:]).sum())
                out += [self._proxy(fd, pid, e) for e in got[:bad][ok[:bad]]]
                first += bad if writing else len(got)
                break
            out += [self._proxy(fd, pid, e) for e in got]
            first += len(got)
        self._drained[key] = (first - 1, lost)
        return out, lost

    def _proxy(self, fd: int, pid: int, e) -> dict:
        w = e["wait_ns"]
        return {"timestamp_ns": int(e["start_ns"]), "duration_ns": int(e["stop_ns"]) - int(e["start_ns"]),
                "op": self._name(fd, pid, int(e["func"])), "seq": int(e["op_seq"]) if e["func"] else None,
                "channel": int(e["channel"]), "is_send": bool(e["is_send"]), "peer": int(e["peer"]),
                "net": PROXY_NETS.get(int(e["net"])), "nic_device": e["nic_device"].decode(errors="replace") or None,
                "nic_port": int(e["nic_port"]) if e["nic_port"] >= 0 else None,
                "nic_index": int(e["nic_index"]) if e["nic_index"] >= 0 else None, "bytes": int(e["bytes"]),
                "nsteps": int(e["nsteps"]), "steps": int(e["steps"]),
                **{name: int(w[i]) for i, name in enumerate(PROXY_WAITS)}}

    def _name(self, fd: int, pid: int, addr: int) -> str | None:
        """The op of NCCL's function name at `addr` (a static string of NCCL's: read once)."""
        key = (pid, addr)
        if key not in self._names:
            name = None
            if addr:
                try:
                    raw = os.pread(fd, 32, addr).split(b"\0", 1)[0]
                    name = op_name(raw.decode("ascii")) if raw else None
                except (OSError, UnicodeDecodeError):
                    name = None
            self._names[key] = name
        return self._names[key]


def read_all(reader: Reader, pids, mono_to_wall_ns: int, now_wall_ns: int, rank_of):
    """(pid -> its `nccl_device_inflight` rows now, for each process in `pids` that has a table
    (one that cannot be read whole, or whose communicators are all finalized, has none: the caller
    keeps its last rows, as a rank that gives up on a stuck collective finalizes, then exits);
    the `nccl_proxy` rows of every summary written since the last read, peer_rank filled where
    the peer's process is among `pids`)."""
    tables = {pid: ts for pid in pids if (ts := reader.read(pid))}
    whole = {pid: ts for pid, ts in tables.items() if not any(t.get("partial") for t in ts)}
    open_rows = rows(whole, mono_to_wall_ns, now_wall_ns, rank_of)
    where = {(t["comm_hash"], t["rank"]): rank_of(pid) for pid, ts in tables.items() for t in ts}
    proxy = []
    for pid, ts in tables.items():
        rank = rank_of(pid)
        for t in ts:
            for p in t["proxies"]:
                proxy.append({**p, "timestamp_ns": p["timestamp_ns"] + mono_to_wall_ns, "pid": pid, "rank": rank,
                              "comm_hash": t["comm_hash"], "comm_rank": t["rank"], "lost": t["proxy_lost"],
                              "peer_rank": where.get((t["comm_hash"], p["peer"]))})
    return open_rows, proxy


def rows(tables: dict[int, list[dict]], mono_to_wall_ns: int, now_wall_ns: int, rank_of) -> dict[int, list[dict]]:
    """pid -> its `nccl_device_inflight` rows now, from its tables as Reader.read gave them."""
    out: dict[int, list[dict]] = {}
    for pid, ts in tables.items():
        rank = rank_of(pid)
        mine = []
        for t in ts:
            base = {"pid": pid, "rank": rank, "seen_ns": now_wall_ns, "comm_hash": t["comm_hash"],
                    "comm_rank": t["rank"], "nranks": t["nranks"]}
            mine.append({**base, "slot": None, "op": None, "seq": None, "peer": None, "nchannels": None,
                         "channels_started": None, "channels_stopped": None, "launched_ns": None,
                         "enqueued": None, "device_start_ns": None})
            for o in t["ops"]:
                r = o["rec"]
                seq, dev = int(r["seq"]), int(r["dev_start_ns"])
                mine.append({**base, "slot": o["slot"], "op": o["op"], "seq": None if seq == NO_SEQ else seq,
                             "peer": int(r["peer"]), "nchannels": int(r["nchannels"]),
                             "channels_started": min(o["started"], int(r["nchannels"])),
                             "channels_stopped": o["stopped"],
                             "launched_ns": int(r["host_start_ns"]) + mono_to_wall_ns,
                             "enqueued": bool(r["host_stop_ns"]),
                             "device_start_ns": dev + mono_to_wall_ns if dev and o["started"] else None})
        out[pid] = mine
    return out
