"""Kernel struct field offsets from BTF (ingero_agent/kbtf.py), which place the task_struct fields
bpf/sched.c reads, and the loader's one line on a kernel without CONFIG_SCHED_INFO."""

from __future__ import annotations

import struct

import pytest

from ingero.errors import IngeroError
from ingero_agent import kbtf, probes


def btf_blob() -> bytes:
    """A small BTF: task_struct {int pid; <pad>; struct inner se (via a typedef) at byte 16;
    an anonymous struct {u64 c} at byte 40, in a struct with bit-field member offsets}."""
    strs = b"\0u64\0inner\0a\0b\0inner_t\0task_struct\0pid\0se\0c\0int\0"

    def s(name: str) -> int:
        return strs.index(b"\0" + name.encode() + b"\0") + 1

    def t(name_off, kind, vlen, size_or_type, kflag=0):
        return struct.pack("<III", name_off, (kflag << 31) | (kind << 24) | vlen, size_or_type)

    def member(name_off, tid, bits):
        return struct.pack("<III", name_off, tid, bits)

    types = b"".join([
        t(s("u64"), 1, 0, 8) + struct.pack("<I", 64),                       # 1 INT u64
        t(s("inner"), 4, 2, 16) + member(s("a"), 1, 0) + member(s("b"), 1, 64),   # 2 STRUCT inner
        t(s("inner_t"), 8, 0, 2),                                           # 3 TYPEDEF inner_t
        t(0, 4, 1, 8) + member(s("c"), 1, 0),                               # 4 STRUCT (anonymous)
        t(s("int"), 1, 0, 4) + struct.pack("<I", 32),                       # 5 INT int
        t(s("task_struct"), 4, 3, 48, kflag=1)                              # 6 STRUCT task_struct
        + member(s("pid"), 5, 0) + member(s("se"), 3, 128) + member(0, 4, 320),
    ])
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strs))
    return hdr + types + strs


def test_offsets_follow_typedefs_nested_and_anonymous_members():
    btf = kbtf.Btf(btf_blob())
    assert btf.offset("task_struct", "pid") == 0
    assert btf.offset("task_struct", "se.a") == 16
    assert btf.offset("task_struct", "se.b") == 24
    assert btf.offset("task_struct", "c") == 40
    with pytest.raises(kbtf.BtfError, match="no member se.d"):
        btf.offset("task_struct", "se.d")
    with pytest.raises(kbtf.BtfError, match="no struct"):
        btf.offset("mm_struct", "pgd")


def test_kernel_offsets_without_kernel_btf_is_none(tmp_path):
    assert kbtf.kernel_offsets("task_struct", ("pid",), tmp_path / "vmlinux") is None
    f = tmp_path / "vmlinux"
    f.write_bytes(btf_blob())
    assert kbtf.kernel_offsets("task_struct", ("se.b", "c"), f) == {"se.b": 24, "c": 40}


@pytest.mark.skipif(not kbtf.KERNEL_BTF.is_file(), reason="no kernel BTF")
def test_the_running_kernels_task_struct_has_the_sched_fields():
    offs = kbtf.kernel_offsets("task_struct", tuple(probes.SCHED_TASK_FIELDS.values()))
    assert offs and all(v > 0 and v % 8 == 0 for v in offs.values())


def test_sched_probes_on_a_kernel_without_sched_info_say_so_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(probes, "SCHEDSTAT", tmp_path / "schedstat")
    with pytest.raises(IngeroError) as e:
        probes.sched_cflags()
    assert "CONFIG_SCHED_INFO" in str(e.value) and "\n" not in str(e.value)


def test_sched_flags_place_the_fields_from_btf(monkeypatch, tmp_path):
    (tmp_path / "schedstat").write_text("0 0 0\n")
    monkeypatch.setattr(probes, "SCHEDSTAT", tmp_path / "schedstat")
    f = tmp_path / "vmlinux"
    f.write_bytes(btf_blob())
    monkeypatch.setattr(probes, "KERNEL_BTF", f)
    monkeypatch.setattr(probes, "SCHED_TASK_FIELDS", {"INGERO_A": "se.b", "INGERO_B": "c"})
    assert probes.sched_cflags() == ["-DINGERO_A=24", "-DINGERO_B=40"]
    monkeypatch.setattr(probes, "KERNEL_BTF", tmp_path / "none")
    assert probes.sched_cflags() == []          # the headers' own offsets (bpf/sched.c)
