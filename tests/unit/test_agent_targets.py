"""Target discovery on fixture trees: the pods file, pod cgroups found by UID,
their processes with torchrun identity, pod IPs for the kernel's address map,
and NCCL libraries reported once per file."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ingero.errors import IngeroError
from ingero_agent.targets import AF_INET, AF_INET6, TargetSet, ip_key, load_pods

UID = "aaaa-bbbb"


def _pods_file(tmp: Path, root: Path) -> Path:
    f = tmp / "pods.json"
    f.write_text(json.dumps({"node": "n1", "cgroup_root": str(root), "pods": [
        {"name": "w-0", "namespace": "ml", "uid": UID, "node": "n1",
         "containers": [{"name": "t", "id": "containerd://c0"}], "ips": ["10.1.0.5", "fd00::5"]},
        {"name": "elsewhere", "namespace": "ml", "uid": "cccc", "node": "n2", "ips": ["10.1.0.9"]},
    ]}))
    return f


def _proc(tmp: Path, pid: int, env: bytes, maps: str, root: Path) -> None:
    d = tmp / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} (python) S " + " ".join(["1"] * 18) + " 12345 0 0\n")
    (d / "environ").write_bytes(env)
    (d / "comm").write_text("python\n")
    (d / "maps").write_text(maps)
    (d / "root").symlink_to(root)


def _pod_tree(tmp: Path, procs: str = "") -> tuple[Path, Path, Path]:
    """(cgroup root, the pod's folder, its container's folder holding `procs`), systemd style."""
    root = tmp / "cg"
    pod = root / f"kubepods-pod{UID.replace('-', '_')}.slice"
    cont = pod / "cri-containerd-c0.scope"
    cont.mkdir(parents=True)
    (pod / "cgroup.procs").write_text("")
    (cont / "cgroup.procs").write_text(procs)
    return root, pod, cont


def test_pods_file_errors_name_the_file_and_item(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"pods": [{"name": "a", "uid": "u", "ips": ["nope"]}]}))
    with pytest.raises(IngeroError, match=r"pods\[0\].*'nope' is not an IP"):
        load_pods(f)
    f.write_text("{")
    with pytest.raises(IngeroError, match="not readable JSON"):
        load_pods(f)


def test_ip_keys_put_ipv4_in_the_first_four_bytes():
    assert ip_key("10.1.0.5") == (AF_INET, bytes([10, 1, 0, 5]) + bytes(12))
    fam, b = ip_key("fd00::5")
    assert fam == AF_INET6 and b[0] == 0xFD and b[-1] == 5


def test_scan_finds_the_pod_its_processes_ranks_ips_and_library(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the fixture NCCL library")
    root, pod, cont = _pod_tree(tmp_path, "4242\n")
    croot = tmp_path / "rootfs"
    (croot / "lib").mkdir(parents=True)
    (croot / "lib/n.c").write_text("int ncclAllReduce(void){return 0;}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(croot / "lib/libnccl.so.2"),
                    str(croot / "lib/n.c")], check=True)
    _proc(tmp_path, 4242, b"RANK=5\0WORLD_SIZE=8\0", 
          "7f0000000000-7f0000001000 r-xp 00000000 fd:01 77 /lib/libnccl.so.2\n", croot)

    pods = load_pods(_pods_file(tmp_path, root))
    ts = TargetSet(pods=pods, node="n1", proc=tmp_path / "proc", self_pid=1)
    assert [p.name for p in ts.pods] == ["w-0"]          # the n2 pod is not ours
    snap = ts.scan()
    assert snap.cgroup_ids == {pod.stat().st_ino, cont.stat().st_ino}
    assert snap.ips == {ip_key("10.1.0.5"), ip_key("fd00::5")}
    p = ts.processes[4242]
    assert (p.rank, p.pod.name, p.pod.namespace, p.cgroup_path) == (5, "w-0", "ml", cont)
    assert [lib[0].name for lib in snap.new_libraries] == ["libnccl.so.2"]
    assert ts.scan().new_libraries == []                 # reported once per file


def test_scan_drops_processes_that_left_and_keeps_explicit_pids(tmp_path):
    cg = tmp_path / "job"
    cg.mkdir()
    (cg / "cgroup.procs").write_text("11\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    _proc(tmp_path, 11, b"", "", empty)
    _proc(tmp_path, 12, b"RANK=0\0", "", empty)
    ts = TargetSet(pids=[12], cgroup_paths=[cg], proc=tmp_path / "proc", self_pid=1)
    snap = ts.scan()
    assert snap.tgids == {12} and set(ts.processes) == {11, 12}
    (cg / "cgroup.procs").write_text("")
    ts.scan()
    assert not ts.processes[11].alive and ts.processes[12].alive


def test_the_profiler_plugin_is_looked_for_in_nccl_processes_and_reported_once(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the fixture libraries")
    croot = tmp_path / "rootfs"
    (croot / "lib").mkdir(parents=True)
    for name, body in (("libnccl.so.2", "int ncclAllReduce(void){return 0;}"),
                       ("libnccl-profiler-ingero.so", "unsigned ingero_nccl_profiler_version(void){return 1;}"),
                       ("libnccl-profiler-other.so", "int ncclProfiler_v5;")):
        (croot / "lib" / "x.c").write_text(body + "\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(croot / "lib" / name), str(croot / "lib" / "x.c")],
                       check=True)
    nccl = "7f0000000000-7f0000001000 r-xp 00000000 fd:01 77 /lib/libnccl.so.2\n"
    plugins = ("7f0000002000-7f0000003000 r-xp 00000000 fd:01 78 /lib/libnccl-profiler-other.so\n"
               "7f0000004000-7f0000005000 r-xp 00000000 fd:01 79 /lib/libnccl-profiler-ingero.so\n")
    _proc(tmp_path, 4242, b"", nccl, croot)
    ts = TargetSet(pids=[4242], proc=tmp_path / "proc", self_pid=1)
    assert ts.scan().new_profilers == []             # NCCL loads it with the first communicator
    (tmp_path / "proc" / "4242" / "maps").write_text(nccl + plugins)
    ts.processes[4242].last_lib_check = 0.0           # due for another look
    assert [p.name for p, _ in ts.scan().new_profilers] == ["libnccl-profiler-ingero.so"]
    ts.processes[4242].last_lib_check = 0.0
    assert ts.scan().new_profilers == []             # reported once per file


def test_a_process_gone_before_any_scan_gets_its_pod_from_the_cgroup_its_events_carry(tmp_path):
    # A rank that starts and exits between two scans (a short or crash-looping one) is known
    # only by its events: its pid is gone from /proc, its events' cgroup id is its pod's.
    root, _pod, cont = _pod_tree(tmp_path)
    (tmp_path / "proc").mkdir()
    ts = TargetSet(pods=load_pods(_pods_file(tmp_path, root)), node="n1", proc=tmp_path / "proc", self_pid=1)
    ts.scan()
    cid = cont.stat().st_ino
    assert ts.learn([777, 778], {777: cid, 778: 12345}) == 1     # 778: not a target cgroup
    p = ts.processes[777]
    assert (p.pod.name, p.cgroup_path, p.cgroup_id, p.alive, p.env) == ("w-0", cont, cid, False, {})
    assert 778 not in ts.processes
    ts.scan()                                              # stays known, not alive
    assert ts.processes[777].pod.name == "w-0" and not ts.processes[777].alive
    assert ts.learn([779]) == 0                            # without the events' cgroup: skipped, as before


def test_pid_targets_that_exited_are_reported_gone_and_other_targets_never_are(tmp_path):
    root, pod, _cont = _pod_tree(tmp_path)
    for pid in (4242, 4243):
        _proc(tmp_path, pid, b"RANK=0\0", "", root)
    ts = TargetSet(pids=[4242, 4243], proc=tmp_path / "proc", self_pid=1)
    ts.scan()
    assert ts.pids_gone() == []
    shutil.rmtree(tmp_path / "proc" / "4243")
    ts.scan()
    assert ts.pids_gone() == [4243]
    shutil.rmtree(tmp_path / "proc" / "4242")
    ts.scan()
    assert ts.pids_gone() == [4242, 4243]
    # a zombie (exited, not yet reaped by its parent) is gone; a zombie leader with threads left is not
    for pid in (4242, 4243):
        _proc(tmp_path, pid, b"RANK=0\0", "", root)
        stat = tmp_path / "proc" / str(pid) / "stat"
        stat.write_text(stat.read_text().replace(" S ", " Z "))
        for tid in ((pid, 4250) if pid == 4243 else (pid,)):
            (tmp_path / "proc" / str(pid) / "task" / str(tid)).mkdir(parents=True)
    ts.scan()
    assert ts.pids_gone() == [4242]
    # a cgroup can gain processes again: never "all gone"
    assert TargetSet(cgroup_paths=[pod], proc=tmp_path / "proc", self_pid=1).pids_gone() is None
