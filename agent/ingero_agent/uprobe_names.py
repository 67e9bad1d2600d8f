"""Short, per-tracer names for bcc's uprobe events.

bcc attaches a uprobe through the perf `uprobe` PMU first. Since Linux 6.16
(and stable kernels from July 2025: commit ba677dbe77af, "perf: Revert to
requiring CAP_SYS_ADMIN for uprobes") that PMU refuses a process without
CAP_SYS_ADMIN (EACCES) even with CAP_PERFMON, and bcc falls back to creating
the probe in tracefs (uprobe_events), which needs only write access to that
file. There an event name is at most 64 characters, and bcc builds it from
the whole library path (p__proc_4242_root_usr_lib_..._libnccl_so_2_0x1c2b0):
a container's library path is too long for it (EINVAL), and two tracers on one
node tracing the same library would collide on the same name. This names each
event by prefix, tracer pid, a per-tracer number for the path and the offset.
"""

from __future__ import annotations

import os

MAX_EVENT_NAME = 64   # the kernel's MAX_EVENT_NAME_LEN for probe events
# Appended to a failed uprobe attach's message.
HINT = (" and, without CAP_SYS_ADMIN (kernel 6.16 and later), that tracefs is mounted "
        "writable (bcc then creates uprobes in uprobe_events)")


class ShortNames:
    """A replacement for `BPF._get_uprobe_evname` on one BPF object (also used when
    detaching, so attach and detach agree)."""

    def __init__(self, tracer_pid: int | None = None):
        self.tracer_pid = os.getpid() if tracer_pid is None else tracer_pid
        self.paths: dict[bytes, int] = {}

    def __call__(self, prefix: bytes, path: bytes, addr: int, pid: int) -> bytes:
        n = self.paths.setdefault(bytes(path), len(self.paths))
        name = b"%s_ingero_%d_%d_0x%x" % (prefix, self.tracer_pid, n, addr)
        return name if pid == -1 else b"%s_%d" % (name, pid)


def install(bpf) -> ShortNames:
    """Make `bpf` (a bcc.BPF) name its uprobe events with ShortNames."""
    names = ShortNames()
    bpf._get_uprobe_evname = names
    return names
