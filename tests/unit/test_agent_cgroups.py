"""Finding pod and container cgroup folders by pod UID and container id."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingero_agent.cgroups import (cgroup_id, container_id_of, find_container_dirs, find_pod_dirs,
                                  matches_container, matches_pod, pid_cgroup_path, procs_below)

UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
CID = "3f4a9c0d2e1b"


@pytest.mark.parametrize("name", [
    f"pod{UID}",                                                   # cgroupfs driver
    f"kubepods-burstable-pod{UID.replace('-', '_')}.slice",        # systemd driver
    f"kubepods-pod{UID.replace('-', '_')}.slice",                  # guaranteed QoS
])
def test_pod_folders_match_by_uid_in_both_cgroup_driver_styles(name):
    assert matches_pod(name, UID)


@pytest.mark.parametrize("name", [f"pod{UID}x", "kubepods-burstable.slice",
                                  f"kubepods-pod{UID}.slice"])
def test_other_folders_do_not_match_the_pod(name):
    assert not matches_pod(name, UID)


@pytest.mark.parametrize("name", [f"cri-containerd-{CID}.scope", f"docker-{CID}.scope",
                                  f"crio-{CID}.scope", CID])
def test_container_folders_match_by_id_for_each_runtime(name):
    assert matches_container(name, f"containerd://{CID}")


def test_container_ids_lose_their_runtime_prefix_and_must_match_whole():
    assert container_id_of("containerd://abc") == "abc"
    assert not matches_container(f"cri-containerd-{CID}ff.scope", CID)
    assert not matches_container("anything", "")


def _tree(tmp: Path) -> Path:
    root = tmp / "kubepods.slice"
    pod = root / "kubepods-burstable.slice" / f"kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    (pod / f"cri-containerd-{CID}.scope").mkdir(parents=True)
    (root / "other" / "podffff").mkdir(parents=True)
    (pod / "cgroup.procs").write_text("")
    (pod / f"cri-containerd-{CID}.scope" / "cgroup.procs").write_text("101\n102\n")
    (root / "other" / "podffff" / "cgroup.procs").write_text("900\n")
    return root


def test_pod_and_container_folders_are_found_below_the_root(tmp_path):
    root = _tree(tmp_path)
    pods = find_pod_dirs(root, [UID, "0000"])
    assert list(pods) == [UID] and pods[UID].name.endswith(".slice")
    conts = find_container_dirs(root, [f"containerd://{CID}"])
    assert conts[f"containerd://{CID}"].parent == pods[UID]
    assert cgroup_id(pods[UID]) == pods[UID].stat().st_ino


def test_processes_of_a_pod_include_those_of_its_containers(tmp_path):
    root = _tree(tmp_path)
    pod = find_pod_dirs(root, [UID])[UID]
    procs = procs_below(pod)
    assert set(procs) == {101, 102}
    assert procs[101].name == f"cri-containerd-{CID}.scope"


def test_pid_cgroup_path_joins_the_v2_entry_with_the_mount(tmp_path):
    (tmp_path / "proc/5").mkdir(parents=True)
    (tmp_path / "proc/5/cgroup").write_text("1:cpu:/x\n0::/kubepods.slice/pod1\n")
    mount = Path("/sys/fs/cgroup/unified")
    assert pid_cgroup_path(5, mount, tmp_path / "proc") == mount / "kubepods.slice/pod1"
    assert pid_cgroup_path(6, mount, tmp_path / "proc") is None
