"""The bpf(2) BPF_LINK_CREATE layout mirrored for uprobe_multi links (ingero_agent/uprobe_multi.py)."""

from __future__ import annotations

import ctypes as ct
import re
from pathlib import Path

from ingero_agent.elfsyms import file_offset
from ingero_agent.uprobe_multi import LinkCreate, SYS_BPF


def test_link_create_has_the_offsets_and_size_of_the_uapi_header():
    # include/uapi/linux/bpf.h: link_create { prog_fd, target_fd, attach_type, flags (__u32 each);
    # union { ... uprobe_multi { path, offsets, ref_ctr_offsets, cookies (__aligned_u64 each);
    # cnt, flags, pid, path_fd (__u32 each) } } }: the union starts 8-aligned after 16 bytes
    want = {"prog_fd": 0, "target_fd": 4, "attach_type": 8, "flags": 12, "path": 16, "offsets": 24,
            "ref_ctr_offsets": 32, "cookies": 40, "cnt": 48, "multi_flags": 52, "pid": 56, "path_fd": 60}
    assert {name: getattr(LinkCreate, name).offset for name in want} == want
    assert {name: getattr(LinkCreate, name).size for name in want} == {
        n: (8 if 16 <= off < 48 else 4) for n, off in want.items()}
    assert ct.sizeof(LinkCreate) == 64 and ct.alignment(LinkCreate) == 8


def test_the_bpf_syscall_number_matches_this_machines_headers_where_they_are():
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if header.is_file():
        assert int(re.search(r"#define __NR_bpf (\d+)", header.read_text()).group(1)) == SYS_BPF["x86_64"]
    assert SYS_BPF["aarch64"] == 280        # asm-generic/unistd.h, which arm64 uses


def test_file_offset_maps_an_address_through_the_load_segment_holding_it():
    segs = [(0, 0, 0x1000), (0x1000, 0x401000, 0x2000), (0x3000, 0x404e10, 0x300)]
    assert file_offset(segs, 0x401234) == 0x1234
    assert file_offset(segs, 0x404e20) == 0x3010
    assert file_offset(segs, 0x10) == 0x10
    assert file_offset(segs, 0x403000) is None       # between the segments
