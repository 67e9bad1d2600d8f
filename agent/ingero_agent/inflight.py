"""NCCL calls in flight: which thread of which rank is inside which call, since when.

The NCCL probes write a call only at its return (bpf/nccl.c): a call that never
returns, the calls of a hung job, leaves no event. But between entry and return
the call's frame sits in the thread's slot of `nccl_frames`, open (sp != 0),
with everything its event would carry except the end. So the tracer reads the
slots of the traced processes' threads from user space at each roll and at
stop, and records the open ones, with each thread's state from
/proc/<pid>/task/<tid>/stat (R running, S sleeping, D in I/O, T stopped, ...)
at that moment. The probes do nothing more per call: the cost is here, once per
roll, one lookup per thread.

How a slot is read:
  * task-local storage (BPF_MAP_TYPE_TASK_STORAGE): the map's key from user
    space is a pidfd of the task (kernel/bpf/bpf_task_storage.c,
    bpf_pid_task_storage_lookup_elem). A pidfd of a thread that is not its
    process's leader needs PIDFD_THREAD (Linux 6.9); on older kernels only
    the leader's slot can be read (`threads_readable` says so).
  * the hash fallback, keyed by pid_tgid: looked up directly.

A thread that was inside a call when the probes attached has no open frame:
its entry probe never fired. A job that hung before the trace began is all
such threads. So for a process none of whose threads has entered a call since
the probes attached (no thread has a slot), the calls its threads are inside
are read from their stacks instead (ingero_agent.stackscan), at attach and at
each roll, until one of them makes a traced call.
"""

from __future__ import annotations

import ctypes as ct
import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ingero import schema

PIDFD_THREAD = os.O_EXCL       # include/uapi/linux/pidfd.h: PIDFD_THREAD is O_EXCL
_CALL_OPS = {c for c, n in schema.NCCL_OPS.items()
             if n in schema.COLLECTIVE_OPS + schema.P2P_OPS + ("GROUP_END", "GROUP_SIMULATE_END")}
NCCL_F_IN_GROUP = 1             # bpf/ingero.h


@dataclass(frozen=True)
class Open:
    """One thread's open NCCL call, as its frame holds it (times CLOCK_MONOTONIC ns)."""

    tid: int
    op: str
    since_mono_ns: int
    comm_hash: int
    seq: int
    comm_rank: int
    nranks: int
    peer: int
    in_group: bool


def thread_state(proc: Path, pid: int, tid: int) -> str | None:
    """The one-letter state of a thread (field 3 of /proc/<pid>/task/<tid>/stat); None if gone."""
    try:
        stat = (proc / str(pid) / "task" / str(tid) / "stat").read_bytes()
    except OSError:
        return None
    end = stat.rfind(b")")          # the command name may hold spaces and parentheses
    return stat[end + 2:end + 3].decode() if end > 0 else None


def threads(proc: Path, pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(proc / str(pid) / "task") if t.isdigit())
    except OSError:
        return []


class FrameReader:
    """Reads the open frames of `nccl_frames` in a loaded program (ingero_agent.probes)."""

    def __init__(self, bpf, task_storage: bool):
        from bcc import BPF
        from bcc.libbcc import lib

        self._lib = lib
        self.task_storage = task_storage
        self.fd = lib.bpf_table_fd(bpf.module, b"nccl_frames")
        if self.fd < 0:
            raise KeyError("nccl_frames")
        # the slot's layout as the compiler laid it out (bcc's own description of the map)
        self.Leaf = BPF._decode_table_type(json.loads(lib.bpf_table_leaf_desc(bpf.module, b"nccl_frames")))
        self.threads_readable = True    # False: only each process's leader (no PIDFD_THREAD)

    def _lookup(self, pid: int, tid: int):
        leaf = self.Leaf()
        if not self.task_storage:
            key = ct.c_uint64((pid << 32) | tid)
            return leaf if self._lib.bpf_lookup_elem(self.fd, ct.byref(key), ct.byref(leaf)) == 0 else None
        try:
            fd = os.pidfd_open(tid, 0 if tid == pid else PIDFD_THREAD)
        except OSError as e:
            if e.errno == errno.EINVAL and tid != pid:
                self.threads_readable = False
            return None
        try:
            fd_key = ct.c_int(fd)
            return leaf if self._lib.bpf_lookup_elem(self.fd, ct.byref(fd_key), ct.byref(leaf)) == 0 else None
        finally:
            os.close(fd)

    def frame(self, pid: int, tid: int) -> tuple[bool, Open | None]:
        """(whether the thread entered an NCCL call since the probes attached: it has a slot;
        its open traced call, or None: outside NCCL, untraced, or unreadable)."""
        if not self.threads_readable and tid != pid:
            return False, None
        f = self._lookup(pid, tid)
        if f is None:
            return False, None
        # (task storage keeps a slot for untraced threads too, target 0; the hash only for traced ones)
        if not f.sp or (self.task_storage and not f.target) or f.op not in _CALL_OPS:
            return True, None
        return True, Open(tid=tid, op=schema.NCCL_OPS[f.op], since_mono_ns=int(f.ts), comm_hash=int(f.hash),
                          seq=int(f.seq), comm_rank=int(f.rank), nranks=int(f.nranks), peer=int(f.peer),
                          in_group=bool(f.flags & NCCL_F_IN_GROUP))


def snapshot(reader: FrameReader, proc: Path, pids, mono_to_wall_ns: int, now_wall_ns: int,
             rank_of, stacks=None, previous: dict | None = None) -> list[dict]:
    """One `nccl_inflight` row per thread of each process in `pids`: its state now and its
    open call, if any. `rank_of(pid)`: the process's global rank or None.

    `stacks(pid, tids)` (tid -> the op of the NCCL API call it is inside, from its stack:
    ingero_agent.stackscan) is asked about the threads of a process none of whose threads
    entered an NCCL call since the probes attached: a thread inside a call then was inside it
    when they attached. Its row has the op and no seq, communicator or rank in it; since_ns is
    when it was first seen there (its row in `previous`, (pid, tid) -> last row, when it was
    seen inside the same function last time), so the wait is at least seen_ns - since_ns."""
    rows = []
    for pid in pids:
        rank = rank_of(pid)
        mine, entered_any = [], False
        for tid in threads(proc, pid):
            state = thread_state(proc, pid, tid)
            if state is None:
                continue
            entered, c = reader.frame(pid, tid)
            entered_any |= entered
            row = {"pid": pid, "tid": tid, "rank": rank, "seen_ns": now_wall_ns, "state": state,
                   "op": None, "comm_id_hash": None, "seq": None, "comm_rank": None, "nranks": None,
                   "peer": None, "in_group": None, "since_ns": None}
            if c is not None:
                row.update(op=c.op, comm_id_hash=c.comm_hash or None, seq=c.seq, comm_rank=c.comm_rank,
                           nranks=c.nranks, peer=c.peer, in_group=c.in_group,
                           since_ns=c.since_mono_ns + mono_to_wall_ns)
            mine.append(row)
        if stacks is not None and not entered_any and mine:
            by_tid = {r["tid"]: r for r in mine}
            for tid, op in stacks(pid, [t for t, r in by_tid.items() if r["state"] != "R"]).items():
                row = by_tid[tid]
                last = (previous or {}).get((pid, tid))
                held = last["since_ns"] if last is not None and last["op"] == op and last["comm_rank"] is None else None
                row.update(op=op, since_ns=held or now_wall_ns)
        rows += mine
    return rows
