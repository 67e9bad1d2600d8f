"""The sched and TCP hooks' cached target verdict (bpf/ingero.h ingero_current_is_target; the
sched hook keeps the same cache in its own per-thread slot, bpf/sched.c).

Those hooks run for every thread of the machine; with task-local storage
(INGERO_TASK_STORAGE=1) a thread's verdict is kept in its own storage and
reused while the target maps (target_gen) and the thread's cgroup stay the
same. One thread sleeps in phases while the targets change under it and while
it moves between cgroups: its off-CPU intervals that began inside a phase
must be recorded exactly when the process was a target in that phase. The
same with the verdict uncached (older kernels)."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

from tests.bpf.conftest import cgroup2_mount

SLEEPS = 6
SLEEPER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
/* For every line on stdin: SLEEPS sleeps of 3 ms, then "ok". */
int main(void)
{
    char line[32];
    struct timespec ts = {0, 3000000};
    while (fgets(line, sizeof line, stdin)) {
        for (int i = 0; i < atoi(line); i++)
            nanosleep(&ts, NULL);
        printf("ok\n");
        fflush(stdout);
    }
    return 0;
}
"""


@pytest.fixture
def sleeper(tmp_path):
    src = tmp_path / "sleeper.c"
    src.write_text(SLEEPER_C)
    exe = tmp_path / "sleeper"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(src)], check=True)
    return exe


@pytest.mark.parametrize("storage", ["task", "hash"])
def test_a_thread_off_cpu_is_recorded_exactly_while_it_is_a_target(storage, sleeper, make_cgroup):
    from ingero_agent.probes import ProbeConfig, Probes, task_storage_available

    if storage == "task" and not task_storage_available():
        pytest.skip("this kernel has no task-local storage for tracepoint programs")
    cg = make_cgroup()
    cg_id = os.stat(cg).st_ino
    p = Probes(ProbeConfig(families=("sched",), ringbuf_pages=64, self_tgid=os.getpid(),
                           frame_storage=storage, sched_min_ns=1_000_000))
    proc = subprocess.Popen([str(sleeper)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    windows, events = [], []
    try:
        assert f"-DINGERO_TASK_STORAGE={int(storage == 'task')}" in p.cflags

        def phase(name: str):
            t0 = time.monotonic_ns()
            proc.stdin.write(f"{SLEEPS}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok"
            windows.append((name, t0, time.monotonic_ns()))
            events.append(p.rings["sched"].read())

        phase("no targets")
        p.set_targets(set(), {proc.pid}, set())
        phase("its pid")
        p.set_targets(set(), set(), set())
        phase("no longer")
        p.set_targets({cg_id}, set(), set())
        phase("its cgroup is targeted, it is not in it")
        (cg / "cgroup.procs").write_text(str(proc.pid))
        phase("moved into the cgroup")
        (cgroup2_mount() / "cgroup.procs").write_text(str(proc.pid))
        phase("moved out again")
        (cg / "cgroup.procs").write_text(str(proc.pid))
        p.set_targets(set(), set(), set())
        phase("back in, the cgroup no target")
        proc.stdin.close()
        proc.wait(timeout=10)
        time.sleep(0.05)
        events.append(p.rings["sched"].read())
        assert p.lost()["sched"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        p.close()
    ev = np.concatenate(events)
    ev = ev[ev["pid"] == proc.pid]
    for name, t0, t1 in windows:
        got = ev[(ev["ts_ns"] >= t0) & (ev["ts_ns"] <= t1)]       # intervals that began in the phase
        if name in ("its pid", "moved into the cgroup"):
            assert len(got) >= SLEEPS, (name, len(got))           # every 3 ms sleep, at least
            assert (got["off_ns"] >= 1_000_000).all()
            if name == "moved into the cgroup":
                assert set(got["cgroup_id"].tolist()) == {cg_id}
        else:
            assert len(got) == 0, name
