"""Pod-like cgroup v2 directories for lab ranks, with kubelet's systemd-style paths.

A rank of run <run> on node <node> lives in::

    /sys/fs/cgroup/unified/ingero-lab-<run>/<node>/kubepods.slice/
        kubepods-besteffort.slice/kubepods-besteffort-pod<uid, - as _>.slice/
        cri-containerd-<64 hex>.scope

so the tracer's pod-UID/container-id to cgroup mapping works as on a real
node. Removing a run kills what is left in its tree (``cgroup.kill``) and
removes the directories bottom-up.
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ingero.errors import IngeroError

CGROUP_ROOT = Path(os.environ.get("INGERO_CGROUP_ROOT", "/sys/fs/cgroup/unified"))
RUN_PREFIX = "ingero-lab-"


@dataclass
class Pod:
    """A pod-like identity: name, UID, one container and its cgroup directory."""

    name: str
    namespace: str
    uid: str
    container_id: str  # 64 hex, without the runtime prefix
    cgroup: Path
    node: str
    rank: int | None = None
    ips: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d: dict[str, object] = {
            "name": self.name, "namespace": self.namespace, "uid": self.uid, "node": self.node,
            "containers": [{"name": "trainer", "id": f"containerd://{self.container_id}"}],
            "ips": list(self.ips), "cgroup": str(self.cgroup)}
        if self.rank is not None:
            d["rank"] = self.rank
        return d


def run_cgroup(run_id: str) -> Path:
    return CGROUP_ROOT / f"{RUN_PREFIX}{run_id}"


def node_cgroup_root(run_id: str, node: str) -> Path:
    return run_cgroup(run_id) / node


def make_pod(run_id: str, node: str, name: str, rank: int | None, ips: list[str]) -> Pod:
    """Create the cgroup directories of a new pod on `node` and return it."""
    uid = str(uuid.uuid4())
    cid = secrets.token_hex(32)
    path = (node_cgroup_root(run_id, node) / "kubepods.slice" / "kubepods-besteffort.slice"
            / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice" / f"cri-containerd-{cid}.scope")
    try:
        path.mkdir(parents=True)
    except OSError as e:
        raise IngeroError(f"cannot create cgroup {path}: {e.strerror}; is cgroup v2 mounted at "
                          f"{CGROUP_ROOT} (set INGERO_CGROUP_ROOT)?") from e
    return Pod(name, "default", uid, cid, path, node, rank, ips)


def make_plain(run_id: str, *parts: str) -> Path:
    """A lab cgroup outside any pod (e.g. for CPU hogs)."""
    path = run_cgroup(run_id).joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def procs(path: Path) -> list[int]:
    """Pids directly in `path`."""
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def populated(path: Path) -> bool:
    """Whether any process lives in `path` or below."""
    try:
        for line in (path / "cgroup.events").read_text().splitlines():
            if line.startswith("populated "):
                return line.split()[1] == "1"
    except FileNotFoundError:
        return False
    return False


def kill_tree(path: Path, timeout_s: float = 5.0) -> bool:
    """SIGKILL every process in `path` and below; True once the tree is empty."""
    if not path.exists():
        return True
    try:
        (path / "cgroup.kill").write_text("1")
    except OSError:  # kernels before 5.14: kill pid by pid
        for d, _, _ in os.walk(path):
            for pid in procs(Path(d)):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
    deadline = time.monotonic() + timeout_s
    while populated(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not populated(path)


def remove_tree(path: Path) -> list[str]:
    """Kill what is left in `path`, then rmdir it bottom-up; returns errors."""
    if not path.exists():
        return []
    if not kill_tree(path):
        return [f"cgroup {path}: processes survive SIGKILL"]
    errors = []
    for d, _, _ in sorted(os.walk(path, topdown=False), key=lambda t: -len(t[0])):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError as e:
            errors.append(f"cgroup {d}: {e.strerror}")
    return errors


# The cgroup v1 `cpu` controller, when it is mounted apart from the unified tree (a hybrid
# hierarchy, as on this machine): the lab's CPU-hog share group lives there (`cpu_share_group`).
CPU_V1_ROOT = Path(os.environ.get("INGERO_CPU_V1_ROOT", "/sys/fs/cgroup/cpu"))


def cpu_share_group(run_id: str, shares: dict[str, int]) -> dict[str, Path] | None:
    """Children of one cgroup v1 `cpu` group for the run, with their `cpu.shares`: {name: path}.

    CPU weights set here are relative to each other only: the group as a whole weighs what
    any one session (autogroup) or top-level group weighs on the machine. None when the v1
    cpu controller is not mounted (a pure cgroup v2 machine)."""
    if not (CPU_V1_ROOT / "cpu.shares").exists():
        return None
    top = CPU_V1_ROOT / f"{RUN_PREFIX}{run_id}"
    out = {}
    for name, value in shares.items():
        d = top / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.shares").write_text(str(int(value)))
        out[name] = d
    return out


def remove_cpu_group(run_id: str, timeout_s: float = 5.0) -> list[str]:
    """Kill what is left in the run's v1 cpu group and remove it; returns errors."""
    top = CPU_V1_ROOT / f"{RUN_PREFIX}{run_id}"
    if not top.exists():
        return []
    dirs = sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: -len(p.parts))
    for d in dirs:
        for pid in procs(d):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    errors = []
    deadline = time.monotonic() + timeout_s
    for d in dirs:
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:          # EBUSY until its killed tasks have exited
                if time.monotonic() > deadline:
                    errors.append(f"cgroup {d}: {e.strerror}")
                    break
                time.sleep(0.02)
    return errors


def leftover_runs() -> list[Path]:
    """Run cgroups left by earlier runs (``ingero-lab-*``), in the unified tree and the v1 cpu one."""
    found = []
    for root in (CGROUP_ROOT, CPU_V1_ROOT):
        try:
            found += [p for p in root.iterdir() if p.name.startswith(RUN_PREFIX) and p.is_dir()]
        except FileNotFoundError:
            pass
    return sorted(found)
