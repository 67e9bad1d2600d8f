"""/proc parsing (environ, maps), the NCCL library finder and node identity,
on fixture trees in tmp dirs."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ingero.errors import IngeroError
from ingero_agent import procinfo
from ingero_agent.procinfo import (LibraryFinder, env_bounds, environ_from_memory, node_identity,
                                   parse_environ, parse_maps, read_config_value, read_environ)

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1311 /usr/bin/python3.11
7f00aa000000-7f00aa100000 r-xp 00000000 fd:01 2001 /opt/conda/lib/libnccl.so.2.19.3
7f00aa100000-7f00aa200000 r--p 00100000 fd:01 2001 /opt/conda/lib/libnccl.so.2.19.3
7f00ab000000-7f00ab001000 rw-p 00000000 00:00 0
7f00ac000000-7f00ac001000 r-xp 00000000 fd:01 2002 /usr/lib/libc.so.6
7f00ad000000-7f00ad001000 r-xp 00000000 fd:01 2003 /tmp/gone.so (deleted)
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_environ_keeps_only_torchrun_variables():
    block = b"PATH=/bin\0RANK=3\0LOCAL_RANK=1\0WORLD_SIZE=8\0MASTER_ADDR=10.0.0.1\0X=RANK=9\0"
    env = parse_environ(block)
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}


# A /proc/<pid>/stat line (proc(5): 52 fields) whose comm holds ") " and spaces; fields
# 47..51 are arg_start, arg_end, env_start, env_end, exit_code.
STAT = ("4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 777 1000 50 "
        "18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 4000 4100 4200 "
        "140000000 140000100 140000100 140000300 0\n")


def test_env_bounds_are_fields_50_and_51_of_stat_not_the_argument_bounds():
    assert len(STAT[STAT.rfind(")") + 2:].split()) == 52 - 2
    assert env_bounds(STAT) == (140000100, 140000300)
    hidden = STAT.replace("140000000 140000100 140000100 140000300", "0 0 0 0")
    assert env_bounds(hidden) is None            # no ptrace access: the kernel shows zeros
    assert env_bounds("1 (short) S 0 1") is None


def _child_with_env(env: dict) -> subprocess.Popen:
    """`sleep` with `env`, returned once its exec has set the environment up (the exe link
    changes before env_start/env_end are set)."""
    child = subprocess.Popen(["sleep", "30"], env=env)
    environ = Path(f"/proc/{child.pid}/environ")
    deadline = time.monotonic() + 10
    while b"RANK=" not in environ.read_bytes():
        assert time.monotonic() < deadline, "the child's environment never appeared"
        time.sleep(0.005)
    return child


def test_environment_read_from_process_memory_is_the_environ_file():
    child = _child_with_env({"PATH": "/usr/bin:/bin", "RANK": "5", "WORLD_SIZE": "16",
                             "TORCHELASTIC_RUN_ID": "r1"})
    try:
        block = environ_from_memory(child.pid)
        assert block == Path(f"/proc/{child.pid}/environ").read_bytes()
        assert parse_environ(block) == {"RANK": "5", "WORLD_SIZE": "16", "TORCHELASTIC_RUN_ID": "r1"}
    finally:
        child.kill()
        child.wait()
    assert environ_from_memory(child.pid) == b""          # gone: nothing, no exception


def test_read_environ_falls_back_to_process_memory_when_the_file_is_refused(monkeypatch):
    """Without CAP_DAC_READ_SEARCH the 0400 file of another user's process is refused
    (EACCES) though ptrace access is allowed (tests/bpf/test_capabilities.py shows it for
    real); any other error (e.g. the process is gone) reads as no environment."""
    child = _child_with_env({"RANK": "2", "LOCAL_RANK": "0"})
    real = Path.read_bytes
    refused = f"/proc/{child.pid}/environ"

    def read_bytes(self):
        if str(self) == refused:
            raise PermissionError(13, "Permission denied", refused)
        return real(self)

    try:
        monkeypatch.setattr(Path, "read_bytes", read_bytes)
        assert read_environ(child.pid) == {"RANK": "2", "LOCAL_RANK": "0"}
        monkeypatch.setattr(procinfo, "environ_from_memory", lambda pid, proc: b"")
        assert read_environ(child.pid) == {}
    finally:
        child.kill()
        child.wait()
    monkeypatch.undo()
    assert read_environ(child.pid) == {}


def test_maps_lists_each_file_once_and_skips_anonymous_and_deleted():
    maps = parse_maps(MAPS)
    assert [m.path for m in maps] == ["/usr/bin/python3.11", "/opt/conda/lib/libnccl.so.2.19.3",
                                      "/usr/lib/libc.so.6"]
    assert maps[1].inode == 2001 and maps[1].dev == "fd:01"


def _gcc_lib(out: Path, body: str) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build fixture libraries")
    src = out.with_suffix(".c")
    src.write_text(body)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


NCCL_BODY = "int ncclAllReduce(void){return 0;} int ncclSend(void){return 0;}\n"


def _fake_proc(tmp: Path, pid: int, container_root: Path, lib_paths: list[str]) -> Path:
    proc = tmp / "proc"
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "root").symlink_to(container_root)
    lines = [f"7f00{i:04x}0000-7f00{i:04x}1000 r-xp 00000000 fd:01 {100 + i} {p}"
             for i, p in enumerate(lib_paths)]
    (d / "maps").write_text("\n".join(lines) + "\n")
    return proc


def test_finder_opens_libraries_through_the_process_root(tmp_path):
    root = tmp_path / "container"
    (root / "opt/lib").mkdir(parents=True)
    _gcc_lib(root / "opt/lib/libnccl.so.2", NCCL_BODY)
    proc = _fake_proc(tmp_path, 42, root, ["/usr/lib/libc.so.6", "/opt/lib/libnccl.so.2"])
    found = LibraryFinder(proc).find(42)
    assert found is not None
    path, key, syms = found
    assert path == proc / "42/root/opt/lib/libnccl.so.2"
    assert set(syms) == {"ncclAllReduce", "ncclSend"}


def test_finder_accepts_nccl_linked_into_another_library(tmp_path):
    root = tmp_path / "container"
    (root / "lib").mkdir(parents=True)
    _gcc_lib(root / "lib/libtorch_cuda.so", NCCL_BODY)
    _gcc_lib(root / "lib/libother.so", "int other(void){return 1;}\n")
    proc = _fake_proc(tmp_path, 7, root, ["/lib/libother.so", "/lib/libtorch_cuda.so"])
    found = LibraryFinder(proc).find(7)
    assert found is not None and found[0].name == "libtorch_cuda.so"


def test_finder_ignores_a_libnccl_named_file_without_nccl_symbols(tmp_path):
    root = tmp_path / "container"
    (root / "lib").mkdir(parents=True)
    _gcc_lib(root / "lib/libnccl.so.2", "int not_nccl(void){return 1;}\n")
    proc = _fake_proc(tmp_path, 8, root, ["/lib/libnccl.so.2"])
    assert LibraryFinder(proc).find(8) is None


def test_node_identity_prefers_flag_then_config_then_node_name_then_hostname(tmp_path):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("# agent config\nnode: 'from-config'  # the node\nport: 9000\n")
    env = {"INGERO_CONFIG": str(cfg), "NODE_NAME": "from-env"}
    assert node_identity("from-flag", env) == "from-flag"
    assert node_identity(None, env) == "from-config"
    cfg.write_text("port: 9000\n")
    assert node_identity(None, env) == "from-env"
    assert node_identity(None, {"INGERO_CONFIG": str(cfg)}) == socket.gethostname()


def test_node_identity_rejects_a_missing_config_file_named_by_env(tmp_path):
    with pytest.raises(IngeroError, match="does not exist"):
        node_identity(None, {"INGERO_CONFIG": str(tmp_path / "none.yaml")})


def test_config_reader_reads_top_level_scalars_only(tmp_path):
    cfg = tmp_path / "a.yaml"
    cfg.write_text('nested:\n  node: inner\nnode: "outer"\n')
    assert read_config_value(cfg, "node") == "outer"
    assert read_config_value(cfg, "missing") is None
