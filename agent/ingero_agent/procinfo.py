"""What /proc says about a training process: torchrun identity, NCCL library, name.

Also the node's identity (flag, config file, NODE_NAME, hostname).
Container processes see their own file system: a library path from
/proc/<pid>/maps is opened through /proc/<pid>/root.
"""

from __future__ import annotations

import ctypes
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ingero.errors import IngeroError
from ingero_agent.elfsyms import is_profiler_plugin, nccl_symbols

PROC = Path("/proc")
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
ENV_VARS = TORCHRUN_VARS + ("NCCL_IB_HCA",)   # ... and the RDMA ports NCCL may use (rdma.py)
DEFAULT_CONFIG = Path("/etc/ingero/agent.yaml")


def parse_environ(data: bytes, keys: tuple[str, ...] = ENV_VARS) -> dict[str, str]:
    """The `keys` present in a NUL-separated environment block."""
    out = {}
    for item in data.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            name = k.decode(errors="replace")
            if name in keys:
                out[name] = v.decode(errors="replace")
    return out


ENV_MAX = 1 << 20   # bytes of an environment block read from process memory at most


def read_environ(pid: int, proc: Path = PROC) -> dict[str, str]:
    """The ENV_VARS of process `pid`'s environment ({} when unreadable).

    /proc/<pid>/environ first. It is mode 0400 and owned by the process's
    user, so for a process of another user the agent (uid 0 without
    CAP_DAC_READ_SEARCH) gets EACCES from the file permission check before
    the kernel's ptrace check: then the same bytes (the block between
    env_start and env_end, which is all that file shows) are read from the
    process's memory with process_vm_readv, which needs only ptrace access
    (CAP_SYS_PTRACE for another user's process), no file permission.
    """
    try:
        return parse_environ((proc / str(pid) / "environ").read_bytes())
    except PermissionError:
        return parse_environ(environ_from_memory(pid, proc))
    except OSError:
        return {}


def env_bounds(stat: str) -> tuple[int, int] | None:
    """(env_start, env_end), fields 50 and 51 of a /proc/<pid>/stat text (proc(5);
    48 and 49 are arg_start and arg_end).

    The kernel shows them only to a reader with ptrace access to the process
    (0 otherwise, and for kernel threads and zombies): None then.
    """
    rest = stat[stat.rfind(")") + 2:].split()
    if len(rest) < 49:          # field N is rest[N - 3]
        return None
    start, end = int(rest[47]), int(rest[48])
    return (start, end) if 0 < start < end else None


def environ_from_memory(pid: int, proc: Path = PROC) -> bytes:
    """Process `pid`'s environment block read from its memory (b"" when not allowed or gone)."""
    try:
        bounds = env_bounds((proc / str(pid) / "stat").read_text())
    except OSError:
        return b""
    if bounds is None:
        return b""
    start, end = bounds
    return read_process_memory(pid, start, min(end - start, ENV_MAX))


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = None


def read_process_memory(pid: int, addr: int, length: int) -> bytes:
    """`length` bytes at `addr` in process `pid` (process_vm_readv(2): ptrace attach-mode
    access, i.e. the same user or CAP_SYS_PTRACE, and Yama's ptrace_scope below 3); b"" on error."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.process_vm_readv.restype = ctypes.c_ssize_t
        _libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                           ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    buf = ctypes.create_string_buffer(length)
    local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), length)
    remote = _IoVec(ctypes.c_void_p(addr), length)
    n = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return buf.raw[:n] if n > 0 else b""


def int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v is not None and v.strip() != "" else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Mapping:
    path: str        # as the process sees it
    dev: str         # "fd:01" as in maps
    inode: int


@dataclass(frozen=True)
class MapRange:
    """One line of /proc/<pid>/maps."""
    start: int
    end: int
    perms: str       # "r-xp"
    offset: int      # file offset of `start`
    dev: str
    inode: int
    path: str        # as the process sees it; "" (anonymous) or "[stack]" & co.


def parse_map_ranges(text: str) -> list[MapRange]:
    """Every mapping of a /proc/<pid>/maps text, in address order."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        out.append(MapRange(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), parts[3], int(parts[4]),
                            parts[5].strip() if len(parts) > 5 else ""))
    return out


def parse_maps(text: str) -> list[Mapping]:
    """Distinct file-backed mappings of a /proc/<pid>/maps text, in order."""
    seen, out = set(), []
    for m in parse_map_ranges(text):
        if not m.path.startswith("/") or m.path.endswith(" (deleted)"):
            continue
        key = (m.dev, m.inode, m.path)
        if m.inode and key not in seen:
            seen.add(key)
            out.append(Mapping(m.path, m.dev, m.inode))
    return out


def is_shared_object(path: str) -> bool:
    name = os.path.basename(path)
    return name.endswith(".so") or ".so." in name


def host_path(pid: int, path: str, proc: Path = PROC) -> Path:
    """Where the agent opens a file that process `pid` mapped as `path`."""
    return proc / str(pid) / "root" / path.lstrip("/")


class LibraryFinder:
    """Finds the NCCL library (and Ingero's NCCL profiler plugin) a process maps;
    remembers verdicts per file identity."""

    def __init__(self, proc: Path = PROC):
        self.proc = proc
        self._verdict: dict[tuple[int, int], dict[str, int]] = {}
        self._plugin: dict[tuple[int, int], bool] = {}

    def check(self, path: Path) -> tuple[tuple[int, int], dict[str, int]] | None:
        """((dev, inode), NCCL symbols) of a file, or None if unreadable."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        if key not in self._verdict:
            self._verdict[key] = nccl_symbols(path)
        return key, self._verdict[key]

    def find(self, pid: int) -> tuple[Path, tuple[int, int], dict[str, int]] | None:
        """(host path, (dev, inode), symbols) of the first NCCL library `pid` maps, if any."""
        found = self.find_all(pid)
        return found[0] if found else None

    def find_all(self, pid: int) -> list[tuple[Path, tuple[int, int], dict[str, int]]]:
        """Every NCCL copy `pid` maps, one per file: (host path, (dev, inode), symbols).

        Files named libnccl* come first; then every other mapped shared
        object (NCCL linked into another library, e.g. libtorch_cuda.so,
        also counts). A process may map two copies (a libnccl.so.2 and one
        linked into another library): each is attached.
        """
        libs = self._shared_objects(pid)
        libs.sort(key=lambda m: not os.path.basename(m.path).startswith("libnccl"))
        out = []
        for m in libs:
            hp = host_path(pid, m.path, self.proc)
            got = self.check(hp)
            if got and got[1] and got[0] not in {k for _, k, _ in out}:
                out.append((hp, got[0], got[1]))
        return out

    def find_profilers(self, pid: int) -> list[tuple[Path, tuple[int, int]]]:
        """(host path, (dev, inode)) of every copy of Ingero's NCCL profiler plugin `pid` maps."""
        out = []
        for m in self._shared_objects(pid):
            hp = host_path(pid, m.path, self.proc)
            try:
                st = os.stat(hp)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key not in self._plugin:
                self._plugin[key] = is_profiler_plugin(hp)
            if self._plugin[key] and key not in {k for _, k in out}:
                out.append((hp, key))
        return out

    def _shared_objects(self, pid: int) -> list[Mapping]:
        """The shared objects `pid` maps, one per path."""
        try:
            maps = parse_maps((self.proc / str(pid) / "maps").read_text())
        except OSError:
            return []
        out, seen = [], set()
        for m in maps:
            if is_shared_object(m.path) and m.path not in seen:
                seen.add(m.path)
                out.append(m)
        return out


def process_name(pid: int, proc: Path = PROC) -> str | None:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return None


def start_time_ticks(pid: int, proc: Path = PROC) -> int | None:
    """Field 22 of /proc/<pid>/stat: tells a reused pid from the process we saw."""
    got = process_stat(pid, proc)
    return got[1] if got else None


def process_stat(pid: int, proc: Path = PROC) -> tuple[str, int] | None:
    """(state, start time in ticks): fields 3 and 22 of /proc/<pid>/stat; None when gone.
    State Z or X: the process has exited (a zombie waits for its parent to reap it)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2:].split()
    return (rest[0], int(rest[19])) if len(rest) > 19 else None


def read_config_value(path: Path, key: str) -> str | None:
    """A top-level scalar `key: value` from a small YAML config file."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise IngeroError(f"cannot read agent config {path}: {e.strerror}; fix its permissions "
                          "or point INGERO_CONFIG at a readable file") from e
    for line in lines:
        if not line or line[0] in " \t#-":
            continue
        k, sep, v = line.partition(":")
        if sep and k.strip() == key:
            v = v.split(" #", 1)[0].strip()
            if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                v = v[1:-1]
            return v or None
    return None


def node_identity(flag: str | None = None, env: dict | None = None) -> str:
    """Node name: --node, then the config file's `node`, then NODE_NAME, then hostname."""
    env = os.environ if env is None else env
    if flag:
        return flag
    cfg = Path(env["INGERO_CONFIG"]) if env.get("INGERO_CONFIG") else DEFAULT_CONFIG
    if env.get("INGERO_CONFIG") and not cfg.exists():
        raise IngeroError(f"INGERO_CONFIG={cfg} does not exist; unset it or create the file")
    from_cfg = read_config_value(cfg, "node")
    if from_cfg:
        return from_cfg
    if env.get("NODE_NAME"):
        return env["NODE_NAME"]
    return socket.gethostname()
