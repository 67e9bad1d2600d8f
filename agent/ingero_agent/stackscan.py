"""Which NCCL API call a thread is inside, read from its user stack.

For threads that were already inside a call when the probes attached: their
entry probe never fired, so no frame (ingero_agent.inflight) holds the call,
and a job that hung before the trace began shows nothing else.

A thread blocked in the kernel, or stopped, has its user registers saved:
/proc/<pid>/task/<tid>/syscall ends with its user stack pointer and program
counter (it says "running" for a thread on a CPU, whose registers are live:
nothing is read then). From the stack pointer up, the live part of the stack
holds the return address of every call the thread is inside. A word there
counts as a return address into NCCL when it points into an executable
mapping of the process's NCCL library and the bytes before it, in the
library file, are a call instruction; the NCCL API function whose symbol
range (st_value, st_size: ingero_agent.elfsyms, the table the uprobes use)
holds it is a call the thread is inside. The outermost one (highest on the
stack) is the call the program made; the program counter itself counts too.

Limits: a stale word (a local never overwritten) can still look like a return
address; the call-instruction check makes that rare, not impossible. Only
STACK_WINDOW bytes above the stack pointer are read. An NCCL whose API
symbols are stripped, or a call that has not reached a blocking point, is
not named. On a GPU the host thread of a rank waiting on a collective is
usually in cudaStreamSynchronize (the CUDA runtime), not in NCCL: the
collective only queued work, and nothing is found there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ingero_agent.elfsyms import NotElf, load_segments
from ingero_agent.procinfo import PROC, host_path, parse_map_ranges, read_process_memory

STACK_WINDOW = 256 * 1024     # bytes above the stack pointer read (NCCL's own frames take a few KB)


def user_sp_pc(proc: Path, pid: int, tid: int) -> tuple[int, int] | None:
    """(stack pointer, program counter) of a thread that is not running; None when it is on a
    CPU, gone or unreadable (fs/proc/base.c proc_pid_syscall: the last two fields)."""
    try:
        text = (proc / str(pid) / "task" / str(tid) / "syscall").read_text().split()
    except OSError:
        return None
    if len(text) < 3 or text[0] == "running":
        return None
    return int(text[-2], 16), int(text[-1], 16)


def _is_call_before(tail: bytes) -> bool:
    """Whether `tail` (the bytes right before an address, at least 7) ends with an x86-64 call
    instruction: call rel32, or call through a register or memory operand (ModRM reg field 2)."""
    if tail[-5] == 0xE8:
        return True

    def ff2(i: int, mod: int, rm_ok) -> bool:    # FF /2 at tail[-i], ModRM at tail[-i + 1]
        m = tail[-i + 1]
        return tail[-i] == 0xFF and (m >> 3) & 7 == 2 and m >> 6 == mod and rm_ok(m & 7)
    return (ff2(2, 3, lambda rm: True)                    # call *%reg
            or ff2(2, 0, lambda rm: rm not in (4, 5))     # call *(%reg)
            or ff2(3, 1, lambda rm: rm != 4)              # call *disp8(%reg)
            or ff2(3, 0, lambda rm: rm == 4)              # call *(sib)
            or ff2(4, 1, lambda rm: rm == 4)              # call *disp8(sib)
            or ff2(6, 0, lambda rm: rm == 5)              # call *disp32(%rip)
            or ff2(6, 2, lambda rm: rm != 4)              # call *disp32(%reg)
            or ff2(7, 2, lambda rm: rm == 4))             # call *disp32(sib)


@dataclass
class _Library:
    path: Path
    starts: np.ndarray        # API functions' st_value, sorted
    ends: np.ndarray
    names: list[str]
    segments: list[tuple[int, int, int]]     # PT_LOAD (offset, vaddr, filesz)

    @classmethod
    def read(cls, path: Path, symbols) -> "_Library":
        sizes = getattr(symbols, "sizes", {})
        funcs = sorted((v, v + sizes[n], n) for n, v in symbols.items() if sizes.get(n))
        return cls(path, np.array([f[0] for f in funcs], np.uint64), np.array([f[1] for f in funcs], np.uint64),
                   [f[2] for f in funcs], load_segments(path))

    def vaddr(self, file_offset: int) -> int | None:
        for off, va, size in self.segments:
            if off <= file_offset < off + size:
                return file_offset - off + va
        return None

    def function(self, vaddr: int) -> str | None:
        i = int(np.searchsorted(self.starts, vaddr, side="right")) - 1
        return self.names[i] if i >= 0 and vaddr < int(self.ends[i]) else None

    def called_from(self, f, file_offset: int) -> bool:
        if file_offset < 7:
            return False
        f.seek(file_offset - 7)
        tail = f.read(7)
        return len(tail) == 7 and _is_call_before(tail)


class StackScanner:
    """Finds the NCCL API call each thread of a process is inside, from its stack."""

    def __init__(self, proc: Path = PROC, window: int = STACK_WINDOW):
        self.proc = proc
        self.window = window
        self._libs: dict[tuple[int, int], _Library | None] = {}

    def calls(self, pid: int, tids, lib_path: Path, lib_key: tuple[int, int], symbols) -> dict[int, str]:
        """tid -> the NCCL API function (ncclAllReduce, ...) the thread is inside, for the threads
        of `tids` found inside one; `lib_path`: the NCCL library the process maps (the agent's
        path to it), `symbols` its API functions (ingero_agent.elfsyms.Symbols, with sizes)."""
        lib = self._library(lib_path, lib_key, symbols)
        if lib is None:
            return {}
        try:
            maps = parse_map_ranges((self.proc / str(pid) / "maps").read_text())
        except OSError:
            return {}
        text = [m for m in maps if "x" in m.perms and self._same_file(pid, m.path, lib_key)]
        if not text:
            return {}
        out = {}
        with open(lib_path, "rb") as f:
            for tid in tids:
                regs = user_sp_pc(self.proc, pid, tid)
                if regs is None:
                    continue
                name = self._outermost(pid, regs, maps, text, lib, f)
                if name is not None:
                    out[tid] = name
        return out

    def _same_file(self, pid: int, path: str, key: tuple[int, int]) -> bool:
        """Whether the process's mapped `path` is the library `key` (as LibraryFinder keys it:
        the file seen through /proc/<pid>/root)."""
        if not path.startswith("/"):
            return False
        try:
            st = os.stat(host_path(pid, path, self.proc))
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == key

    def _library(self, path: Path, key, symbols) -> _Library | None:
        if key not in self._libs:
            try:
                self._libs[key] = _Library.read(path, symbols)
            except (OSError, NotElf):
                self._libs[key] = None
        return self._libs[key]

    def _outermost(self, pid: int, regs: tuple[int, int], maps, text, lib: _Library, f) -> str | None:
        sp, pc = regs
        stack = next((m for m in maps if m.start <= sp < m.end), None)
        if stack is None:
            return None
        start = sp & ~7
        data = read_process_memory(pid, start, min(stack.end - start, self.window))
        words = np.frombuffer(data[:len(data) - len(data) % 8], "<u8")
        found = None
        for m in text:
            hit = np.flatnonzero((words >= m.start) & (words < m.end))
            for i in hit.tolist():             # innermost first: the last match is the outermost
                fo = int(words[i]) - m.start + m.offset
                va = lib.vaddr(fo)
                name = lib.function(va) if va is not None else None
                if name is not None and lib.called_from(f, fo) and (found is None or i > found[0]):
                    found = (i, name)
        if found is not None:
            return found[1]
        m = next((m for m in text if m.start <= pc < m.end), None)     # stopped inside the function itself
        va = lib.vaddr(pc - m.start + m.offset) if m is not None else None
        return lib.function(va) if va is not None else None


def scan_supported() -> bool:
    """The scan reads x86-64 call instructions."""
    return os.uname().machine == "x86_64"
