"""`ingero check`: one line per node requirement with its fix, exit 1 when a required one
is missing; on this machine (as root) every requirement holds, on a fake root each one
fails with its fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ingero.cli import main
from ingero_agent.check import checks

RELEASE = "6.1.0-99-amd64"


def ready_root(tmp: Path) -> Path:
    """A node root as the agent needs it (the files the checks read, in their layout)."""
    (tmp / "sys/kernel/btf").mkdir(parents=True)
    (tmp / "sys/kernel/btf/vmlinux").write_bytes(b"\x9f\xeb")
    (tmp / f"lib/modules/{RELEASE}/build/include").mkdir(parents=True)
    (tmp / "sys/kernel/tracing/events").mkdir(parents=True)
    (tmp / "sys/kernel/tracing/uprobe_events").write_text("")
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/mounts").write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec 0 0\n")
    return tmp


@pytest.mark.skipif(os.geteuid() != 0, reason="tracefs is readable by root only")
def test_this_machine_is_ready(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in out[:6]] == ["ok"] * 6, out
    assert out[-1] == "ready: the agent can trace on this node"


def test_a_ready_fake_root_passes_and_an_nccl_library_is_recognised(tmp_path, capsys):
    from ingero.lab.build import build_lab_binaries
    root = ready_root(tmp_path / "root")
    lib = build_lab_binaries().libnccl
    assert main(["check", "--root", str(root), "--kernel-release", RELEASE, "--nccl-lib", str(lib)]) == 0
    out = capsys.readouterr().out
    assert out.count("\nok ") == 6 and out.startswith("ok "), out
    assert f"ok       NCCL library    {lib}: " in out


def test_each_missing_requirement_is_one_line_with_its_fix_and_exit_1(tmp_path, capsys):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mounts").write_text("cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n")     # v1 only
    (tmp_path / "README.md").write_text("# not a library\n")
    assert main(["check", "--root", str(tmp_path), "--kernel-release", "4.19.0-amd64",
                 "--nccl-lib", str(tmp_path / "README.md")]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 7 and all(ln.startswith("missing ") and "; fix: " in ln for ln in lines), lines
    by_name = {c.name: c for c in checks(tmp_path, "4.19.0-amd64", tmp_path / "README.md")}
    assert "upgrade the node's kernel to 5.8" in by_name["kernel"].fix
    assert "CONFIG_DEBUG_INFO_BTF" in by_name["kernel BTF"].fix
    assert "linux-headers-amd64" in by_name["kernel headers"].fix
    assert "mount -t tracefs" in by_name["tracefs"].fix
    assert "is not an NCCL library" in by_name["NCCL library"].detail
    assert captured.err == ("not ready: kernel, kernel BTF, kernel headers, tracefs, uprobes, cgroup v2, "
                            "NCCL library missing\n")


def test_nccl_not_found_on_the_node_is_optional(tmp_path, capsys):
    root = ready_root(tmp_path)
    assert main(["check", "--root", str(root), "--kernel-release", RELEASE]) == 0
    assert capsys.readouterr().out.splitlines()[-2].startswith("optional NCCL library    none on the node's")


def test_headers_under_usr_src_count_the_agent_links_them(tmp_path):
    root = ready_root(tmp_path)
    (root / f"lib/modules/{RELEASE}/build/include").rmdir()
    (root / "usr/src/linux-headers-6.1.0-50-amd64/include").mkdir(parents=True)
    [h] = [c for c in checks(root, RELEASE) if c.name == "kernel headers"]
    assert h.ok and "the agent links it" in h.detail
