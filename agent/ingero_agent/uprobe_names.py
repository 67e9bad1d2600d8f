"""Short, per-tracer names for bcc's uprobe events.

bcc attaches a uprobe through the perf `uprobe` PMU first. Since Linux 6.16
(and stable kernels from July 2025: commit ba677dbe77af, "perf: Revert to
requiring CAP_SYS_ADMIN for uprobes") that PMU refuses a process without
CAP_SYS_ADMIN (EACCES) even with CAP_PERFMON, and bcc falls back to creating
the probe in tracefs (uprobe_events), which needs only write access to that
file. There an event name is at most 64 characters, and bcc builds it from
the whole library path and appends _bcc_<pid>
(p__proc_4242_root_usr_lib_..._libnccl_so_2_0x1c2b0_bcc_77): a container's
library path is too long for it (EINVAL, "Event name is too long" in
tracefs's error_log). This names each event by prefix, tracer pid, a
per-tracer number for the path and the offset.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

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


def tracefs_dir() -> Path:
    """The tracefs folder bcc writes probe events to (its choice: debugfs's first)."""
    legacy = Path("/sys/kernel/debug/tracing")
    return legacy if legacy.exists() else Path("/sys/kernel/tracing")


def remove_stale(tracer_pid: int, tracefs: Path | None = None) -> list[str]:
    """Remove the uprobe events named for `tracer_pid` that a killed earlier tracer with
    this pid left (a tracer stopped normally removes its own). No live process but this
    one has this pid, so none of them is in use; creating one again would fail (EEXIST).
    Returns the names removed."""
    events = (tracefs or tracefs_dir()) / "uprobe_events"
    mine = f"_ingero_{tracer_pid}_"
    removed = []
    for full in _defined(events) or ():
        if mine not in full:
            continue
        try:
            write_events(events, f"-:{full}\n")
            removed.append(full)
        except OSError:
            pass                                   # busy or not ours to remove: leave it
    return removed


def remove_left(names: list, tries: int = 20, pause_s: float = 0.05, tracefs: Path | None = None) -> int:
    """At a tracer's exit, after its probes were detached: remove those of its uprobe events
    `names` (bcc's event names) that are still defined. bcc closes an event's perf fd and then
    writes its removal; the kernel refuses that (EBUSY) while the closed event is not yet
    released, which a busy machine makes likelier, and bcc does not try again. Retried
    `tries` times, `pause_s` apart; returns how many are left."""
    events = (tracefs or tracefs_dir()) / "uprobe_events"
    want = {n.decode() if isinstance(n, bytes) else str(n) for n in names}
    ours = lambda: [f for f in _defined(events) or () if f.rpartition("/")[2] in want]
    for i in range(tries):
        left = ours()
        if not left:
            return 0
        if i:
            time.sleep(pause_s)
        for full in left:
            try:
                write_events(events, f"-:{full}\n")
            except OSError:
                pass                                       # still busy: the next round
    return len(ours())


def _defined(events: Path) -> list[str] | None:
    """The uprobe events defined in tracefs's `events` file (group/name, e.g.
    uprobes/p_ingero_42_0_0x1139); None when it cannot be read."""
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        head = line.split(None, 1)[0] if line.strip() else ""
        kind, _, full = head.partition(":")          # p:uprobes/p_ingero_42_0_0x1139
        if kind in ("p", "r"):
            out.append(full)
    return out


def write_events(events: Path, command: str) -> None:
    """One command to a tracefs probe-events file (O_APPEND, no seek: tracefs refuses
    the seek to the end that Python's append mode makes)."""
    fd = os.open(events, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, command.encode())
    finally:
        os.close(fd)


def install(bpf) -> ShortNames:
    """Make `bpf` (a bcc.BPF) name its uprobe events with ShortNames (first removing
    events a killed tracer with this pid left)."""
    names = ShortNames()
    remove_stale(names.tracer_pid)
    bpf._get_uprobe_evname = names
    return names
