"""cgroup v2 lookups: ids, pod and container folders, member processes.

A cgroup's id (what ``bpf_get_current_cgroup_id()`` returns) is the inode
number of its folder in the cgroup2 file system. Kubernetes names pod and
container folders after the pod UID and the container id, differently per
cgroup driver and runtime:

    systemd driver   kubepods-burstable-pod<uid with - as _>.slice
                     cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope
    cgroupfs driver  pod<uid>/<id>
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
CONTAINER_PREFIXES = ("cri-containerd-", "crio-", "docker-", "containerd-")


def cgroup2_mount(mounts: Path = Path("/proc/self/mounts")) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup or .../unified)."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(parts[1].replace("\\040", " "))
    return None


def cgroup_id(path: Path) -> int:
    """The cgroup id of a cgroup folder (its inode number)."""
    return os.stat(path).st_ino


def pod_dir_names(uid: str) -> tuple[str, str]:
    """Folder names a pod's cgroup can have: cgroupfs style and systemd style suffix."""
    uid = uid.strip().lower()
    return f"pod{uid}", f"-pod{uid.replace('-', '_')}.slice"


def container_id_of(ref: str) -> str:
    """'containerd://abc…' -> 'abc…' (runtime prefix removed)."""
    return ref.split("://", 1)[1] if "://" in ref else ref


def matches_pod(name: str, uid: str) -> bool:
    plain, systemd = pod_dir_names(uid)
    return name == plain or name.endswith(systemd)


def matches_container(name: str, container_id: str) -> bool:
    cid = container_id_of(container_id).lower()
    if not cid:
        return False
    if name == cid:
        return True
    stem = name[:-len(".scope")] if name.endswith(".scope") else name
    return any(stem == p + cid for p in CONTAINER_PREFIXES)


def walk_dirs(root: Path, max_depth: int = 12):
    """Every cgroup folder below `root` (inclusive), parents before children."""
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        yield d
        if depth >= max_depth:
            continue
        try:
            with os.scandir(d) as it:
                subs = [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        stack.extend((s, depth + 1) for s in sorted(subs, reverse=True))


def find_pod_dirs(root: Path, uids: list[str]) -> dict[str, Path]:
    """uid -> the pod's cgroup folder, for the pods found below `root`."""
    want = {u: pod_dir_names(u) for u in uids}
    found: dict[str, Path] = {}
    for d in walk_dirs(root):
        for uid, (plain, systemd) in want.items():
            if uid not in found and (d.name == plain or d.name.endswith(systemd)):
                found[uid] = d
        if len(found) == len(want):
            break
    return found


def find_container_dirs(root: Path, container_ids: list[str]) -> dict[str, Path]:
    """container id (as given) -> its cgroup folder, for those found below `root`."""
    found: dict[str, Path] = {}
    if not container_ids:
        return found
    for d in walk_dirs(root):
        for cid in container_ids:
            if cid not in found and matches_container(d.name, cid):
                found[cid] = d
        if len(found) == len(container_ids):
            break
    return found


def procs_below(root: Path) -> dict[int, Path]:
    """pid -> the cgroup folder holding it, for every process in `root`'s subtree."""
    out: dict[int, Path] = {}
    for d in walk_dirs(root):
        try:
            text = (d / "cgroup.procs").read_text()
        except OSError:
            continue
        for tok in text.split():
            if tok.isdigit():
                out[int(tok)] = d
    return out


def cgroup2_mounts(mounts: Path = Path("/proc/self/mounts")) -> list[Path]:
    """Every cgroup v2 mount point the agent sees (its own, and a host one it is given)."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return []
    return [Path(p[1].replace("\\040", " ")) for p in (ln.split() for ln in lines)
            if len(p) >= 3 and p[2] == "cgroup2"]


def mount_of(path: Path | None, mounts: list[Path]) -> Path | None:
    """The cgroup2 mount holding `path` (longest prefix), e.g. the host hierarchy
    mounted into the agent's container as /host/sys/fs/cgroup."""
    if path is None:
        return None
    best = None
    for m in mounts:
        if (path == m or m in path.parents) and (best is None or len(m.parts) > len(best.parts)):
            best = m
    return best


def pid_cgroup_path(pid: int, mount: Path | None, proc: Path = PROC) -> Path | None:
    """The cgroup v2 folder of process `pid` below `mount` (None when unknown).

    /proc/<pid>/cgroup is relative to the READER's cgroup namespace: inside the
    agent's container (private cgroupns) a pod's path reads like
    `/../../kubepods.slice/...`. `mount` should be the host hierarchy the agent
    is given (not its own namespace's mount): the leading `..` are dropped and
    the rest looked up there; if that folder does not exist, the deepest
    existing folder whose path ends with the same components is taken (the
    last ones, the pod and container scopes, are unique)."""
    if mount is None:
        return None
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if not line.startswith("0::"):
            continue
        parts = [c for c in line[3:].strip().split("/") if c and c != "."]
        while parts and parts[0] == "..":
            parts.pop(0)
        if not parts:
            return mount
        direct = mount.joinpath(*parts)
        if direct.is_dir() or ".." not in line:
            return direct
        tail = tuple(parts)
        for d in walk_dirs(mount):
            if d.parts[-len(tail):] == tail:
                return d
        return None
    return None
