"""What to trace: pids, cgroup folders, pods (a JSON file) or everything.

``TargetSet.scan()`` is called at start and about once a second: it finds pod
and container cgroups that appeared, lists their processes, reads each new
process's torchrun variables and looks for an NCCL library it maps (again on
later scans while none is found: libraries load after the process starts),
and, in processes that have NCCL, for Ingero's NCCL profiler plugin (NCCL
loads it when the first communicator is created).
Quick scans in between (``scan(quick=True)``) skip the pod search; the
snapshot says whether anything was new (processes, libraries, young
processes still without a library), which keeps the tracer's quick scans
frequent, and lets them back off while nothing changes.

Pods file (shared with the lab and the operator)::

    {"node": "n1", "cgroup_root": "/sys/fs/cgroup/unified/kubepods.slice",
     "pods": [{"name": "w-0", "namespace": "default", "uid": "…", "node": "n1",
               "containers": [{"name": "trainer", "id": "containerd://<hex>"}],
               "ips": ["10.0.0.1", "fd00::1"]}],
     "nccl_libs": ["/host/path/libnccl.so.2"]}

``nccl_libs`` (optional) names NCCL libraries, as host paths, to attach
before any rank starts, like ``--nccl-lib``: a rank that calls
ncclCommInitRank within milliseconds of starting is otherwise faster than
the scan that would find its library.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ingero.errors import IngeroError
from ingero_agent import cgroups
from ingero_agent.procinfo import (LibraryFinder, host_path, int_or_none, process_name, process_stat,
                                   read_environ, start_time_ticks)

AF_INET, AF_INET6 = 2, 10
LIB_RECHECK_FAST_S = 60.0   # look for a library at every scan while a process is this young
CLK_TCK = os.sysconf("SC_CLK_TCK")
LIB_RECHECK_SLOW_S = 10.0   # then this often


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    uid: str
    node: str | None = None
    containers: tuple[tuple[str, str], ...] = ()   # (name, id)
    ips: tuple[str, ...] = ()


@dataclass
class PodsSpec:
    node: str | None
    cgroup_root: Path | None
    pods: list[Pod]
    nccl_libs: list[Path] = field(default_factory=list)


def _need(obj: dict, key: str, where: str, kind=str):
    v = obj.get(key)
    if not isinstance(v, kind) or (kind is str and not v):
        raise IngeroError(f"{where}: '{key}' is missing or not a {kind.__name__}; "
                          "see `ingero trace --help` for the pods file format")
    return v


def load_pods(path: Path) -> PodsSpec:
    """Read and check a pods file; errors name the file and the item."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise IngeroError(f"pods file {path} does not exist; pass the JSON file that lists "
                          "the pods to trace") from None
    except (OSError, ValueError) as e:
        raise IngeroError(f"pods file {path} is not readable JSON ({e}); fix the file") from None
    if not isinstance(data, dict) or not isinstance(data.get("pods"), list):
        raise IngeroError(f"pods file {path}: expected an object with a 'pods' list")
    pods = []
    for i, p in enumerate(data["pods"]):
        where = f"pods file {path}, pods[{i}]"
        if not isinstance(p, dict):
            raise IngeroError(f"{where}: expected an object")
        containers = []
        for j, c in enumerate(p.get("containers") or []):
            if not isinstance(c, dict):
                raise IngeroError(f"{where}.containers[{j}]: expected an object")
            containers.append((str(c.get("name") or ""), str(c.get("id") or "")))
        ips = p.get("ips") or []
        for ip in ips:
            try:
                ipaddress.ip_address(ip)
            except (ValueError, TypeError):
                raise IngeroError(f"{where}: '{ip}' is not an IP address; fix 'ips'") from None
        pods.append(Pod(name=_need(p, "name", where), namespace=str(p.get("namespace") or "default"),
                        uid=_need(p, "uid", where), node=p.get("node"),
                        containers=tuple(containers), ips=tuple(ips)))
    root = data.get("cgroup_root")
    if root is not None and not Path(root).is_dir():
        raise IngeroError(f"pods file {path}: cgroup_root {root} is not a folder; "
                          "point it at the cgroup v2 folder that holds the pods")
    libs = data.get("nccl_libs") or []
    if not isinstance(libs, list) or not all(isinstance(x, str) and x for x in libs):
        raise IngeroError(f"pods file {path}: 'nccl_libs' must be a list of library paths")
    return PodsSpec(node=data.get("node"), cgroup_root=Path(root) if root else None, pods=pods,
                    nccl_libs=[Path(x) for x in libs])


def ip_key(ip: str) -> tuple[int, bytes]:
    """(family, 16 bytes: IPv4 in the first 4) as the kernel's target_ips map wants."""
    a = ipaddress.ip_address(ip)
    if a.version == 4:
        return AF_INET, a.packed + bytes(12)
    return AF_INET6, a.packed


@dataclass
class Process:
    pid: int
    start_ticks: int | None
    name: str | None
    env: dict[str, str]
    cgroup_path: Path | None
    cgroup_id: int | None
    pod: Pod | None
    first_seen_ns: int
    started_boot_s: float = 0.0     # process start, seconds since boot (CLOCK_BOOTTIME)
    nccl_path: Path | None = None
    nccl_key: tuple[int, int] | None = None
    nccl_symbols: dict[str, int] = field(default_factory=dict)
    profiler_key: tuple[int, int] | None = None   # Ingero's NCCL profiler plugin, once mapped
    last_lib_check: float = 0.0
    alive: bool = True

    @property
    def rank(self) -> int | None:
        return int_or_none(self.env.get("RANK"))


@dataclass
class Snapshot:
    cgroup_ids: set[int]
    tgids: set[int]
    ips: set[tuple[int, bytes]]
    new_libraries: list[tuple[Path, tuple[int, int], dict[str, int]]]
    new_profilers: list[tuple[Path, tuple[int, int]]] = field(default_factory=list)
    new_processes: int = 0
    awaiting_library: int = 0   # young live processes in which no NCCL library was found yet
    notes: list[str] = field(default_factory=list)   # for the log: e.g. a library path a pod lacks


class TargetSet:
    def __init__(self, pids=(), cgroup_paths=(), pods: PodsSpec | None = None,
                 trace_all: bool = False, node: str | None = None, proc: Path = Path("/proc"),
                 finder: LibraryFinder | None = None, self_pid: int | None = None):
        self.proc = proc
        self.trace_all = trace_all
        self.mount = cgroups.cgroup2_mount()
        self.pids = [self._check_pid(p) for p in pids]
        self.cgroup_dirs = [self._check_cgroup(p) for p in cgroup_paths]
        self.node = node
        self.pods = [p for p in (pods.pods if pods else []) if not p.node or not node or p.node == node]
        self.pod_root = (pods.cgroup_root if pods and pods.cgroup_root else self.mount)
        # Processes are resolved against the hierarchy holding the pods' cgroup_root (the
        # host's, as mounted into the agent's container), not the agent's own namespace.
        self.host_mount = cgroups.mount_of(self.pod_root, cgroups.cgroup2_mounts()) or self.mount
        if pods and self.pod_root is None:
            raise IngeroError("no cgroup v2 file system is mounted and the pods file has no "
                              "cgroup_root; mount cgroup2 or set cgroup_root")
        self.finder = finder or LibraryFinder(proc)
        self.self_pid = self_pid if self_pid is not None else os.getpid()
        self.processes: dict[int, Process] = {}
        self.pod_dirs: dict[str, list[Path]] = {}   # pod uid -> its cgroup folders
        self.cgroup_by_id: dict[int, tuple[Path, Pod | None]] = {}   # target cgroup id -> folder, pod (last scan)
        self._libraries: set[tuple[int, int]] = set()   # NCCL libraries and profiler plugins
        # NCCL library paths as the pods' containers see them (--nccl-lib, a TraceSession's
        # ncclLibPath): looked up through /proc/<pid>/root of each new target process, so
        # the library is attached before the process loads it, whatever its host path
        self.libs_in_pods: list[str] = []
        self._lib_notes: set[tuple[str, str]] = set()

    def _check_pid(self, pid) -> int:
        try:
            pid = int(pid)
        except (TypeError, ValueError):
            raise IngeroError(f"--pid {pid!r} is not a number; pass a process id") from None
        if pid <= 0 or not (self.proc / str(pid)).is_dir():
            raise IngeroError(f"pid {pid} does not exist; pass the pid of a running process")
        return pid

    def _check_cgroup(self, path) -> Path:
        p = Path(path)
        if not p.is_absolute() and self.mount is not None:
            p = self.mount / p
        elif not p.exists() and self.mount is not None and not str(p).startswith(str(self.mount)):
            p = self.mount / str(p).lstrip("/")
        if not (p / "cgroup.procs").exists():
            raise IngeroError(f"cgroup {path} does not exist; pass a cgroup v2 folder "
                              f"(under {self.mount or 'the cgroup2 mount'}) or a path relative to it")
        return p

    def pids_gone(self) -> list[int] | None:
        """With only --pid targets: those that have exited (all of them: nothing is left to
        trace); None when other targets (cgroups, pods, everything) can still gain processes."""
        if not self.pids or self.cgroup_dirs or self.pods or self.trace_all:
            return None
        return [p for p in self.pids if not (p in self.processes and self.processes[p].alive)]

    def describe(self) -> str:
        parts = []
        if self.trace_all:
            parts.append("all processes")
        if self.pids:
            parts.append("pids " + ",".join(map(str, self.pids)))
        if self.cgroup_dirs:
            parts.append("cgroups " + ",".join(map(str, self.cgroup_dirs)))
        if self.pods:
            parts.append("pods " + ",".join(f"{p.namespace}/{p.name}" for p in self.pods))
        return "; ".join(parts) or "nothing"

    def replace_pods(self, pods: PodsSpec) -> None:
        """A new pods list for the running session (a re-plan: a restarted rank is a new
        pod). Folders of pods still listed are kept; the next full scan finds the new ones."""
        self.pods = [p for p in pods.pods if not p.node or not self.node or p.node == self.node]
        keep = {p.uid for p in self.pods}
        for uid in [u for u in self.pod_dirs if u not in keep]:
            del self.pod_dirs[uid]

    def pod_for_ip(self) -> dict[str, Pod]:
        return {ip: p for p in self.pods for ip in p.ips}

    def _find_pods(self) -> None:
        for uid in [u for u, dirs in self.pod_dirs.items() if not all(d.is_dir() for d in dirs)]:
            del self.pod_dirs[uid]
        missing = [p for p in self.pods if p.uid not in self.pod_dirs]
        if not missing or self.pod_root is None:
            return
        found = cgroups.find_pod_dirs(self.pod_root, [p.uid for p in missing])
        for uid, d in found.items():
            self.pod_dirs[uid] = [d]
        ids = [(p.uid, cid) for p in missing if p.uid not in found for _, cid in p.containers if cid]
        if ids:
            by_cid = cgroups.find_container_dirs(self.pod_root, [cid for _, cid in ids])
            for uid, cid in ids:
                if cid in by_cid:
                    self.pod_dirs.setdefault(uid, []).append(by_cid[cid])

    def _members(self) -> tuple[dict[int, tuple[Path | None, Pod | None]], set[int]]:
        """pid -> (cgroup folder, pod) of every target process; ids of every target cgroup."""
        members: dict[int, tuple[Path | None, Pod | None]] = {}
        ids: set[int] = set()
        roots: list[tuple[Path, Pod | None]] = [(d, None) for d in self.cgroup_dirs]
        by_uid = {p.uid: p for p in self.pods}
        roots += [(d, by_uid[uid]) for uid, dirs in self.pod_dirs.items() for d in dirs]
        by_id: dict[int, tuple[Path, Pod | None]] = {}
        for root, pod in roots:
            for d in cgroups.walk_dirs(root):
                try:
                    cid = cgroups.cgroup_id(d)
                except OSError:
                    continue
                ids.add(cid)
                by_id[cid] = (d, pod)
            for pid, d in cgroups.procs_below(root).items():
                members[pid] = (d, pod)
        for pid in self.pids:
            members.setdefault(pid, (None, None))
        if self.trace_all:
            for e in os.scandir(self.proc):
                if e.name.isdigit():
                    members.setdefault(int(e.name), (None, None))
        members.pop(self.self_pid, None)
        self.cgroup_by_id = by_id
        return members, ids

    def scan(self, now_wall_ns: int | None = None, quick: bool = False) -> Snapshot:
        """Refresh processes, cgroup ids and libraries.

        A quick scan (up to ten times a second while processes are new or
        still without a library, so a library is attached before a new rank
        gets far) skips the search for pod folders not yet found and looks
        for libraries only in processes that are still young.
        """
        if not quick:
            self._find_pods()
        members, ids = self._members()
        now = time.monotonic()
        boot_now = time.clock_gettime(time.CLOCK_BOOTTIME)
        wall = now_wall_ns if now_wall_ns is not None else time.time_ns()
        for p in self.processes.values():
            p.alive = p.pid in members
        fresh, fresh_procs = 0, []
        for pid, (cg_dir, pod) in members.items():
            st = process_stat(pid, self.proc)
            if st is None or (st[0] in "ZX" and not self._threads_left(pid)):
                # exited (a --pid target stays listed in members)
                if pid in self.processes:
                    self.processes[pid].alive = False
                continue
            ticks = st[1]
            p = self.processes.get(pid)
            if p is None or p.start_ticks != ticks:
                p = self._new_process(pid, ticks, cg_dir, pod, wall)
                self.processes[pid] = p
                fresh += 1
                fresh_procs.append(p)
            p.alive = True
        for p in self.processes.values():   # first seen through its events, not resolved yet
            if (p.cgroup_id is None or p.pod is None) and p.pid not in members \
                    and (self.proc / str(p.pid)).is_dir():
                self._resolve(p)
        new_libs = []
        notes: list[str] = []
        for p in fresh_procs:
            new_libs += self._libs_in_root(p, notes)
        awaiting = 0
        new_plugins: list[tuple[Path, tuple[int, int]]] = []
        for p in self.processes.values():
            if not p.alive or (p.nccl_key is not None and p.profiler_key is not None):
                continue
            young = boot_now - p.started_boot_s < LIB_RECHECK_FAST_S
            if quick and not young and p.last_lib_check:
                continue
            if p.last_lib_check and not young and now - p.last_lib_check < LIB_RECHECK_SLOW_S:
                continue
            p.last_lib_check = now
            if p.nccl_key is None:
                found = self.finder.find_all(p.pid)
                if found:
                    p.nccl_path, p.nccl_key, p.nccl_symbols = found[0]
                    for got in found:   # every copy the process maps is attached
                        if got[1] not in self._libraries:
                            self._libraries.add(got[1])
                            new_libs.append(got)
                elif young:
                    awaiting += 1
            if p.nccl_key is not None:
                for path, key in self.finder.find_profilers(p.pid):
                    p.profiler_key = key
                    if key not in self._libraries:
                        self._libraries.add(key)
                        new_plugins.append((path, key))
        ips = {ip_key(ip) for pod in self.pods for ip in pod.ips}
        return Snapshot(cgroup_ids=ids, tgids=set(self.pids), ips=ips, new_libraries=new_libs,
                        new_profilers=new_plugins, new_processes=fresh, awaiting_library=awaiting,
                        notes=notes)

    def _threads_left(self, pid: int) -> bool:
        """A zombie leader whose other threads still run (it called pthread_exit) lives on."""
        try:
            return sum(1 for _ in os.scandir(self.proc / str(pid) / "task")) > 1
        except OSError:
            return False

    def learn(self, pids, cgroup_of: dict[int, int] | None = None) -> int:
        """Add processes the kernel reported as targets before a scan listed them.

        `cgroup_of`: pid -> the cgroup id its events carry. A process that is gone already
        (it ran and exited between two scans: a short-lived or crash-looping rank) is added,
        not alive, when that id is a target cgroup of the last scan: its pod is that
        cgroup's, its environment unknown. Otherwise a gone pid is skipped. Returns how many
        were added.
        """
        added = 0
        for pid in pids:
            if pid in self.processes:
                continue
            ticks = start_time_ticks(pid, self.proc)
            if ticks is not None:
                self.processes[pid] = self._new_process(pid, ticks, None, None, time.time_ns())
            elif cgroup_of and cgroup_of.get(pid) in self.cgroup_by_id:
                d, pod = self.cgroup_by_id[cgroup_of[pid]]
                self.processes[pid] = Process(pid=pid, start_ticks=None, name=None, env={}, cgroup_path=d,
                                              cgroup_id=cgroup_of[pid], pod=pod, first_seen_ns=time.time_ns(),
                                              alive=False)
            else:
                continue
            added += 1
        return added

    def _resolve(self, p: "Process") -> None:
        """Retry the cgroup folder, id and pod of a process learnt from its events."""
        if p.cgroup_id is None:
            p.cgroup_path = cgroups.pid_cgroup_path(p.pid, self.host_mount, self.proc)
            try:
                p.cgroup_id = cgroups.cgroup_id(p.cgroup_path) if p.cgroup_path else None
            except OSError:
                p.cgroup_id = None
        if p.pod is None and p.cgroup_path is not None:
            for uid, dirs in self.pod_dirs.items():
                if any(d == p.cgroup_path or d in p.cgroup_path.parents for d in dirs):
                    p.pod = next(x for x in self.pods if x.uid == uid)

    def _new_process(self, pid, ticks, cg_dir, pod, wall_ns) -> Process:
        cg_path = cg_dir or cgroups.pid_cgroup_path(pid, self.host_mount, self.proc)
        try:
            cg_id = cgroups.cgroup_id(cg_path) if cg_path else None
        except OSError:
            cg_id = None
        if pod is None and cg_path is not None:
            for uid, dirs in self.pod_dirs.items():
                if any(d == cg_path or d in cg_path.parents for d in dirs):
                    pod = next(p for p in self.pods if p.uid == uid)
        return Process(pid=pid, start_ticks=ticks, name=process_name(pid, self.proc),
                       env=read_environ(pid, self.proc), cgroup_path=cg_path, cgroup_id=cg_id,
                       pod=pod, first_seen_ns=wall_ns, started_boot_s=ticks / CLK_TCK)

    def _libs_in_root(self, p: "Process", notes: list[str]) -> list:
        """The `libs_in_pods` files as process `p` sees them, not attached yet."""
        out = []
        for path in self.libs_in_pods:
            hp = host_path(p.pid, path, self.proc)
            got = self.finder.check(hp)
            who = f"pod {p.pod.namespace}/{p.pod.name}" if p.pod else f"pid {p.pid}"
            if got is None or not got[1]:
                if (who, path) not in self._lib_notes and (self.proc / str(p.pid)).exists():
                    self._lib_notes.add((who, path))
                    notes.append(f"{path} {'is not in' if got is None else 'defines no NCCL functions in'} "
                                 f"{who}'s file system; its NCCL library is attached when it maps one")
                continue
            if got[0] not in self._libraries:
                self._libraries.add(got[0])
                out.append((hp, got[0], got[1]))
        return out

    def mark_library_attached(self, key: tuple[int, int]) -> None:
        """A library attached up front (--nccl-lib, --profiler-lib) is not reported as new again."""
        self._libraries.add(key)
