"""A process first seen through its events is resolved against the HOST cgroup
hierarchy the agent is given, not the agent's own (namespaced) mount, and a
process still unresolved is retried at later scans."""

from __future__ import annotations

from pathlib import Path

from ingero_agent import cgroups
from ingero_agent.targets import TargetSet


def _proc(tmp: Path, pid: int, cgroup_line: str) -> Path:
    proc = tmp / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(cgroup_line + "\n")
    return proc


def test_the_host_mount_holding_cgroup_root_is_chosen_over_the_agents_own():
    mounts = [Path("/sys/fs/cgroup"), Path("/host/sys/fs/cgroup")]
    assert cgroups.mount_of(Path("/host/sys/fs/cgroup/kubepods.slice"), mounts) == Path("/host/sys/fs/cgroup")
    assert cgroups.mount_of(Path("/sys/fs/cgroup/x"), mounts) == Path("/sys/fs/cgroup")
    assert cgroups.mount_of(Path("/elsewhere"), mounts) is None


def test_a_namespaced_path_with_dotdot_resolves_below_the_host_mount(tmp_path):
    host = tmp_path / "host-cgroup"
    ctr = host / "kubepods.slice" / "kubepods-pod1.slice" / "cri-containerd-abc.scope"
    ctr.mkdir(parents=True)
    # as read from inside the agent's container (private cgroup namespace)
    proc = _proc(tmp_path, 42, "0::/../../kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope")
    assert cgroups.pid_cgroup_path(42, host, proc) == ctr


def test_a_namespaced_path_whose_prefix_differs_is_found_by_its_unique_tail(tmp_path):
    host = tmp_path / "host-cgroup"
    ctr = host / "system.slice" / "kubepods.slice" / "pod1" / "cri-containerd-abc.scope"
    ctr.mkdir(parents=True)
    proc = _proc(tmp_path, 43, "0::/../kubepods.slice/pod1/cri-containerd-abc.scope")
    assert cgroups.pid_cgroup_path(43, host, proc) == ctr


def test_a_host_namespace_path_is_joined_to_the_mount_as_before(tmp_path):
    host = tmp_path / "host-cgroup"
    proc = _proc(tmp_path, 44, "0::/kubepods.slice/pod2")
    assert cgroups.pid_cgroup_path(44, host, proc) == host / "kubepods.slice" / "pod2"


def test_a_process_learnt_from_events_is_resolved_again_once_its_cgroup_appears(tmp_path):
    host = tmp_path / "host-cgroup"
    host.mkdir()
    proc = _proc(tmp_path, 45, "0::/../../kubepods.slice/pod3/ctr")
    (proc / "45" / "stat").write_text("45 (w) S " + " ".join(["0"] * 19) + " 100 0\n")
    (proc / "45" / "environ").write_bytes(b"RANK=3\0")
    (proc / "45" / "comm").write_text("w\n")
    ts = TargetSet(proc=proc)
    ts.host_mount = host
    assert ts.learn([45]) == 1
    assert ts.processes[45].cgroup_id is None          # its folder is not there yet
    (host / "kubepods.slice" / "pod3" / "ctr").mkdir(parents=True)
    ts.scan()
    p = ts.processes[45]
    assert p.cgroup_path == host / "kubepods.slice" / "pod3" / "ctr"
    assert p.cgroup_id == (host / "kubepods.slice" / "pod3" / "ctr").stat().st_ino
