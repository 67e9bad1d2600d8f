"""Background load: busy processes that keep the whole machine busy, as a shared node or a
CI machine running beside other work is.

The lab's verdicts must hold on such a machine, not only on a quiet one. The load is a mix,
alternating between:

- ``spin``: a pure CPU busy loop;
- ``churn``: reads 1 MiB from /dev/urandom into a pipe and discards it, over and over
  (system calls, page faults, the kernel's share of a busy node).

The processes are unpinned (the scheduler moves them across every CPU, ranks included),
live in their own lab cgroup (never in a pod, so no probe traces them), and are removed with
the rest of the run.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ingero.lab import cgroups

KINDS = {
    "spin": "while :; do :; done",
    "churn": "while :; do head -c 1048576 /dev/urandom | cat > /dev/null; done",
}


def start_background_load(count: int, cgroup: Path) -> list[subprocess.Popen]:
    """Start `count` busy processes (spin, churn, spin, …) in `cgroup`; returns once each
    sits in it (so the load is on before the ranks start)."""
    procs_file = cgroup / "cgroup.procs"
    kinds = list(KINDS)
    out = []
    for i in range(count):
        script = KINDS[kinds[i % len(kinds)]]
        argv = ["sh", "-c", f'echo $$ > "$0" && exec sh -c \'{script}\'', str(procs_file)]
        out.append(subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        inside = set(cgroups.procs(cgroup))
        if all(p.pid in inside or p.poll() is not None for p in out):
            break
        time.sleep(0.002)
    return out
