"""Off-CPU intervals of target threads by reason: a sleeper (voluntary sleep),
two CPU burners sharing one CPU (runqueue wait) and a vfork parent waiting
for its child (uninterruptible, reported as io), plus the in-kernel totals."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.bpf.conftest import spawn

SLEEPER = "import time\nfor _ in range(10): time.sleep(0.03)\n"
BURNER = "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass\n"
VFORK_C = r"""
#include <unistd.h>
#include <time.h>
int main(void) {
    for (int i = 0; i < 5; i++) {
        pid_t p = vfork();            /* the parent waits, uninterruptible, until the child exits */
        if (p == 0) {
            struct timespec ts = {0, 40 * 1000 * 1000};
            nanosleep(&ts, 0);
            _exit(0);
        }
    }
    return 0;
}
"""


def test_off_cpu_time_is_recorded_by_reason_for_target_threads_only(trace, make_cgroup, tmp_path):
    if shutil.which("gcc") is None or shutil.which("taskset") is None:
        pytest.skip("gcc and taskset are needed for the scheduler workload")
    src = tmp_path / "vfork.c"
    src.write_text(VFORK_C)
    vfork = tmp_path / "vfork"
    subprocess.run(["gcc", "-O1", "-o", str(vfork), str(src)], check=True)
    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "sched", "--sched-min-us", "2000")
    sleeper = spawn([sys.executable, "-c", SLEEPER], cg)
    burners = [spawn(["taskset", "-c", "0", sys.executable, "-c", BURNER], cg) for _ in range(2)]
    waiter = spawn([str(vfork)], cg)
    outsider = spawn([sys.executable, "-c", SLEEPER])
    for p in [sleeper, *burners, waiter, outsider]:
        assert p.wait(30) == 0
    t.stop()

    def rows(pid):
        return t.query("SELECT reason, duration_ns, runq_ns FROM sched_events WHERE pid = ?", [pid])

    sleeps = [r for r in rows(sleeper.pid) if r[0] == "sleep" and r[1] >= 25_000_000]
    assert len(sleeps) >= 9
    for b in burners:
        waits = [r for r in rows(b.pid) if r[0] == "runqueue"]
        assert waits and all(d == q for _, d, q in waits)
    ios = [r for r in rows(waiter.pid) if r[0] == "io" and r[1] >= 35_000_000]
    assert len(ios) >= 4
    assert rows(outsider.pid) == []
    assert all(d >= 2_000_000 for (d,) in t.query("SELECT duration_ns FROM sched_events"))
    totals = dict(((pid, reason), total) for pid, reason, total in
                  t.query("SELECT pid, reason, total_ns FROM sched_totals"))
    # Each of the 10 sleeps is 30 ms from the timer's start to the wake-up. The timer starts just
    # before the switch out: a preemption in between is runqueue time, and so is the wait after
    # the wake-up on a busy machine. Sleep and runqueue together cover the 300 ms, sleep most.
    slept, queued = totals[(sleeper.pid, "sleep")], totals.get((sleeper.pid, "runqueue"), 0)
    assert slept + queued >= 0.98 * 300_000_000 and slept >= 150_000_000, (slept, queued)
    assert totals[(waiter.pid, "io")] >= 5 * 35_000_000
    assert all(totals.get((b.pid, "runqueue"), 0) > 100_000_000 for b in burners)
    assert not any(pid == outsider.pid for pid, _ in totals)
