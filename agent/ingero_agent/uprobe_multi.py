"""Uprobes through BPF uprobe_multi links (Linux 6.6 and later).

A perf-event uprobe (bcc's attach_uprobe) costs the tracer's stop ~0.1 s: the
kernel releases each one under its global event_mutex with a grace-period wait
inside (perf_trace_destroy), so ~50 of them take seconds however they are
closed. One uprobe_multi link attaches a program to many offsets of one file;
closing it unregisters them all and waits for one grace period, under no
global lock, so links closed side by side share their waits.

The link is made with bpf(2) BPF_LINK_CREATE (bcc 0.26 has no call for it);
its program must have been loaded with expected_attach_type
BPF_TRACE_UPROBE_MULTI (bcc's BPF.load_func(..., attach_type=)), and such a
program cannot be attached to a perf event. Offsets are file offsets in the
ELF file (ingero_agent.elfsyms.file_offset). The programs run with the same
pt_regs context as on a perf-event uprobe; the pid field of the link is left 0
(every process that maps the file), as the in-kernel target filter decides
whose calls are recorded.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os

# From the kernel's include/uapi/linux/bpf.h (as libbpf/libbpf ships it): enum bpf_cmd,
# enum bpf_attach_type, and the enum of link_create.uprobe_multi.flags.
BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1 << 0
# __NR_bpf: arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h (arm64)
SYS_BPF = {"x86_64": 321, "aarch64": 280}
FORCE_OFF = "INGERO_UPROBE_MULTI"   # =0: behave as on a kernel without uprobe_multi links


class LinkCreate(ct.Structure):
    """union bpf_attr's `link_create` member (the struct used by BPF_LINK_CREATE) with its
    `uprobe_multi` arm, as in include/uapi/linux/bpf.h: prog_fd, target_fd, attach_type and
    flags, then the union (8-byte aligned) whose uprobe_multi is path, offsets,
    ref_ctr_offsets, cookies (__aligned_u64 each), cnt, flags, pid and path_fd (__u32 each;
    path_fd is newer than 6.6 and read only with BPF_F_UPROBE_MULTI_PATH_FD, left 0 here)."""
    _fields_ = [("prog_fd", ct.c_uint32), ("target_fd", ct.c_uint32), ("attach_type", ct.c_uint32),
                ("flags", ct.c_uint32),
                ("path", ct.c_uint64), ("offsets", ct.c_uint64), ("ref_ctr_offsets", ct.c_uint64),
                ("cookies", ct.c_uint64), ("cnt", ct.c_uint32), ("multi_flags", ct.c_uint32),
                ("pid", ct.c_uint32), ("path_fd", ct.c_uint32)]


_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


def link_create(prog_fd: int, path: bytes, offsets: list[int], retprobe: bool = False) -> int:
    """A uprobe_multi link running `prog_fd` at each file offset of `path` (on return with
    `retprobe`); returns its fd. Raises OSError with the kernel's errno."""
    nr = SYS_BPF.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"no bpf(2) number known for {os.uname().machine}")
    offs = (ct.c_uint64 * len(offsets))(*offsets)
    name = ct.create_string_buffer(bytes(path))
    attr = LinkCreate(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI,
                      path=ct.addressof(name), offsets=ct.addressof(offs), cnt=len(offsets),
                      multi_flags=BPF_F_UPROBE_MULTI_RETURN if retprobe else 0)
    fd = _libc.syscall(ct.c_long(nr), ct.c_int(BPF_LINK_CREATE), ct.byref(attr), ct.c_uint(ct.sizeof(attr)))
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return int(fd)


def unsupported(prog_fd: int) -> str | None:
    """None when this kernel makes uprobe_multi links for `prog_fd` (a program loaded with
    BPF_TRACE_UPROBE_MULTI); else why not, in a few words. The probe asks for a link on
    "/": a kernel with uprobe_multi finds the path is no regular file (EBADF) and makes
    nothing; an older one refuses the attach type (EINVAL), or bpf(2) itself."""
    if os.environ.get(FORCE_OFF) == "0":
        return f"{FORCE_OFF}=0"
    try:
        fd = link_create(prog_fd, b"/", [0])
    except OSError as e:
        return None if e.errno == errno.EBADF else f"BPF_LINK_CREATE: {e.strerror}"
    os.close(fd)              # not reached on a kernel that checks the path
    return "BPF_LINK_CREATE attached to a directory"
