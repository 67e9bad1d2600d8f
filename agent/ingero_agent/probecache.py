"""Compiled probes kept on the node, so that the probes are compiled once, not per tracer.

bcc compiles the probes' C inside the process (clang, then LLVM) whenever a BPF object is
made: 2.4 s of CPU for all families here, a minute and more on a node at load 30, and
every tracer (one per session, one per lab node) compiles the same text with the same
flags. Nothing in that text or those flags is a session's (targets live in maps; the
tracer's own tgid too), so the result is kept:

- after a compile, the bytecode of every program goes into the cache folder under the hash
  of all that decides it: the C text, the -D flags, bcc's version, the kernel's release
  and build (bcc's rewrites and the tracepoints' formats are the kernel's), with the place
  and the map of each map reference (a 64-bit load of a map fd: bcc writes its own fds in);
- a later tracer compiles only the maps (the same text with -DINGERO_MAPS_ONLY=1: every
  declaration, no program; about a fifth of a full compile), so bcc's tables and ring
  buffers work as before, and loads each program from the cache, with its own maps' fds
  written in, when bcc would have loaded it (tracepoints at once, uprobes at attach). The
  kernel verifies each program as at any load.

Tracers that start together wait for the first one's compile (a lock file per entry).
An entry that cannot be read, names a map the maps compile lacks, or whose tracepoint
programs fail to load is compiled again (and rewritten). The agent runs as root and loads what it finds here: the
folder must be this user's and writable by nobody else, and so must each entry, else the
cache is not used. INGERO_BPF_CACHE names the folder (default /var/cache/ingero/bpf; the
node agent's tracers use one in its data folder where they cannot write that: a container's
root file system is read-only); "off" compiles every time.
"""

from __future__ import annotations

import base64
import ctypes as ct
import errno
import fcntl
import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV = "INGERO_BPF_CACHE"
DEFAULT_DIR = Path("/var/cache/ingero/bpf")
MAPS_ONLY = "-DINGERO_MAPS_ONLY=1"
FORMAT = 1          # of an entry; part of the key
KEEP = 16           # entries kept in the folder (newest first): other kernels, other sources
LOCK_WAIT_S = 600.0  # a tracer waits this long at most for another's compile of its entry

LD_IMM64 = 0x18     # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
PSEUDO_MAP_FD = 1   # its src_reg when the immediate is a map fd
INSN = 8


def folder() -> Path | None:
    """The cache folder (None: off)."""
    env = os.environ.get(ENV)
    if env in ("off", "0"):
        return None
    return Path(env) if env else DEFAULT_DIR


def writable(where: Path) -> bool:
    """Can this user keep entries in `where` (made if missing)?"""
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        return _private(os.stat(where)) and os.access(where, os.W_OK)
    except OSError:
        return False


def key(text: str, cflags: list[str], bcc_version: str) -> str:
    u = os.uname()
    h = hashlib.sha256()
    for part in (str(FORMAT), bcc_version, u.release, u.version, u.machine, text, *cflags):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def read(where: Path, k: str) -> dict | None:
    """The entry `k`, or None (none, unreadable, or not this user's alone)."""
    path = where / f"{k}.json"
    try:
        if not _private(os.stat(where)):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not _private(os.fstat(fd)):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != k:
        return None
    return entry


def write(where: Path, k: str, entry: dict) -> None:
    """Store `entry` as `k` (atomically), keeping the KEEP newest entries. Raises OSError."""
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(os.stat(where)):
        raise OSError(errno.EPERM, f"{where} is not this user's alone (owner, or writable by others)")
    fd, tmp = tempfile.mkstemp(dir=where, prefix=".tmp-")   # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dict(entry, format=FORMAT, key=k), f)
        os.replace(tmp, where / f"{k}.json")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    entries = sorted(where.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".lock").unlink(missing_ok=True)


@contextmanager
def compiling(where: Path, k: str):
    """Held by the tracer that compiles entry `k`: tracers that start together (a lab's, a
    node's sessions) wait for its entry rather than compile it too. Without a lock file
    (the folder cannot be made) or after LOCK_WAIT_S, the caller compiles anyway."""
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(where / f"{k}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)     # releases the lock


# ---- bytecode -------------------------------------------------------------------

def _lib():
    from bcc.libbcc import lib
    lib.bpf_num_tables.restype = ct.c_ulonglong
    lib.bpf_num_tables.argtypes = [ct.c_void_p]
    lib.bpf_table_name.restype = ct.c_char_p
    lib.bpf_table_name.argtypes = [ct.c_void_p, ct.c_ulonglong]
    lib.bpf_table_fd_id.restype = ct.c_int
    lib.bpf_table_fd_id.argtypes = [ct.c_void_p, ct.c_ulonglong]
    return lib


def map_refs(code: bytes, fds: dict[int, str]) -> list[tuple[int, str]] | None:
    """(instruction index, map name) of every map fd load in `code`; None when one
    loads an fd not in `fds` or a reference of another kind (map values)."""
    refs = []
    i = 0
    while i < len(code) // INSN:
        op, regs = code[i * INSN], code[i * INSN + 1]
        if op == LD_IMM64:
            src = regs >> 4
            if src == PSEUDO_MAP_FD:
                fd = int.from_bytes(code[i * INSN + 4:i * INSN + 8], "little", signed=True)
                if fd not in fds:
                    return None
                refs.append((i, fds[fd]))
            elif src:
                return None
            i += 2
            continue
        i += 1
    return refs


def with_fds(code: bytes, refs: list[tuple[int, str]], fd_of) -> bytes:
    """`code` with each map reference loading fd_of(map name)."""
    out = bytearray(code)
    for i, name in refs:
        out[i * INSN + 4:i * INSN + 8] = int(fd_of(name)).to_bytes(4, "little", signed=True)
    return bytes(out)


def extract(bpf) -> dict | None:
    """The cache entry of a compiled bcc BPF object (None: it cannot be kept)."""
    lib = _lib()
    m = bpf.module
    fds = {lib.bpf_table_fd_id(m, i): lib.bpf_table_name(m, i).decode()
           for i in range(lib.bpf_num_tables(m))}
    programs = {}
    for i in range(lib.bpf_num_functions(m)):
        name = lib.bpf_function_name(m, i)
        code = ct.string_at(lib.bpf_function_start(m, name), lib.bpf_function_size(m, name))
        refs = map_refs(code, fds)
        if refs is None:
            return None
        programs[name.decode()] = {"code": base64.b64encode(code).decode(), "maps": refs}
    return {"license": lib.bpf_module_license(m).decode(),
            "kern_version": lib.bpf_module_kern_version(m), "programs": programs}


def classes(BPF):
    """(Deferred, Cached): subclasses of bcc's BPF that attach the tracepoint programs
    only when told to (`attach_tracepoints`: BPF() itself attaches them at once, before the
    caller could fill a map they read), and whose programs come from a cache entry rather
    than from the module (compiled with MAPS_ONLY: the maps alone)."""

    class Deferred(BPF):
        def __init__(self, **kw):
            self._autoload = False   # BPF.__init__ calls _trace_autoload: not yet
            super().__init__(**kw)

        def _trace_autoload(self):
            if self._autoload:
                super()._trace_autoload()

        def attach_tracepoints(self) -> None:
            self._autoload = True
            self._trace_autoload()

    class Cached(Deferred):
        def __init__(self, entry: dict, **kw):
            self._entry = entry
            super().__init__(**kw)

        def load_func(self, func_name, prog_type, device=None, attach_type=-1):
            name = func_name if isinstance(func_name, bytes) else func_name.encode()
            prog = self._entry["programs"].get(name.decode())
            if name in self.funcs or prog is None:
                return super().load_func(name, prog_type, device, attach_type)
            code = with_fds(base64.b64decode(prog["code"]), prog["maps"], self._map_fd)
            fd = _lib().bcc_func_load(self.module, prog_type, name, ct.create_string_buffer(code, len(code)),
                                      len(code), self._entry["license"].encode(),
                                      self._entry["kern_version"], 0, None, 0, device, attach_type)
            if fd < 0:
                raise Exception(f"Failed to load BPF program {name.decode()}: {os.strerror(ct.get_errno())}")
            fn = BPF.Function(self, name, fd)
            self.funcs[name] = fn
            return fn

        def _map_fd(self, table: str) -> int:
            fd = _lib().bpf_table_fd(self.module, table.encode())
            if fd < 0:
                raise KeyError(table)
            return fd

        def missing_maps(self) -> set[str]:
            names = {n for p in self._entry["programs"].values() for _, n in p["maps"]}
            return {n for n in names if _lib().bpf_table_fd(self.module, n.encode()) < 0}

        def _trace_autoload(self):
            """bcc's autoload for the cached programs (tracepoints: their names say which)."""
            if not self._autoload:
                return
            for name in self._entry["programs"]:
                b = name.encode()
                if b.startswith(b"tracepoint__"):
                    self.attach_tracepoint(tp=b[len(b"tracepoint__"):].replace(b"__", b":"), fn_name=b)
                elif b.startswith(b"raw_tracepoint__"):
                    self.attach_raw_tracepoint(tp=b[len(b"raw_tracepoint__"):], fn_name=b)

    return Deferred, Cached


def compile_or_load(BPF, text: str, cflags: list[str], prepare: Callable[[Any], None]) -> tuple[Any, str]:
    """A bcc BPF object for `text` and `cflags`, as `BPF(text=..., cflags=...)` makes it
    except that prepare(it) runs before its tracepoint programs are attached; and how it
    was made: "cached", "compiled" (and kept), or "compiled (why not kept)". Raises what
    bcc raises for the compile or a load."""
    Deferred, Cached = classes(BPF)
    where = folder()
    if where is None:
        return _compile(Deferred, text, cflags, prepare), f"compiled ({ENV}=off)"
    from bcc import __version__ as bcc_version
    k = key(text, cflags, bcc_version)
    entry = read(where, k)
    b = _from_cache(Cached, entry, text, cflags, prepare)
    if b is not None:
        return b, "cached"
    with compiling(where, k):
        if entry is None:      # another tracer may have made it meanwhile
            b = _from_cache(Cached, read(where, k), text, cflags, prepare)
            if b is not None:
                return b, "cached"
        b = _compile(Deferred, text, cflags, prepare)
        entry = extract(b)
        if entry is None:
            return b, "compiled (not kept: a program refers to something other than its maps)"
        try:
            write(where, k, entry)
        except OSError as e:
            return b, f"compiled (not kept: {where}: {e.strerror or e})"
    return b, "compiled"


def _from_cache(Cached, entry: dict | None, text: str, cflags: list[str], prepare):
    """The programs of `entry` on a maps-only compile, tracepoints attached; None when
    there is no entry or it does not serve (the caller compiles)."""
    if entry is None:
        return None
    b = None
    try:
        b = Cached(entry, text=text.encode(), cflags=cflags + [MAPS_ONLY])
        if not b.missing_maps():
            prepare(b)
            b.attach_tracepoints()
            return b
    except Exception:   # bcc: bare Exception; the full compile after says what is wrong
        pass
    if b is not None:
        b.cleanup()
    return None


def _compile(Deferred, text: str, cflags: list[str], prepare):
    b = Deferred(text=text.encode(), cflags=cflags)
    try:
        prepare(b)
        b.attach_tracepoints()
    except BaseException:
        b.cleanup()
        raise
    return b
