"""The NCCL probes' per-thread frames and the target filter's cached verdict.

With task-local frames (bpf/nccl.c, INGERO_TASK_STORAGE=1) a thread's filter
verdict is kept in its frame and reused while the target maps (target_gen)
and the thread's cgroup stay the same. One thread of one process calls
ncclAllReduce in phases while the targets change under it and while it moves
between cgroups: every phase must be recorded exactly when the process is a
target at that moment. The same as on an older kernel: frames in the hash, and
each uprobe a perf event of its own instead of the uprobe_multi links
(INGERO_UPROBE_MULTI=0). Both run on programs loaded from the node's cache of
compiled probes (ingero_agent/probecache.py), made by the compile just before."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.bpf.conftest import cgroup2_mount

PHASES_C = r"""
#include <stdio.h>
#include <stdlib.h>
typedef struct { int x; } *ncclComm_t;
int ncclAllReduce(const void *s, void *r, size_t count, int dt, int op, ncclComm_t comm, void *stream);
/* For every line N on stdin: N all-reduces (count 1000 + phase), then "ok". */
int main(void)
{
    char line[32];
    int phase = 0;
    while (fgets(line, sizeof line, stdin)) {
        int n = atoi(line);
        for (int i = 0; i < n; i++)
            ncclAllReduce(0, 0, 1000 + phase, 7, 0, 0, (void *)0x5eed);
        printf("ok\n");
        fflush(stdout);
        phase++;
    }
    return 0;
}
"""


KERNEL = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])


def _link_type(fd: int) -> str | None:
    """The kind of BPF link `fd` is, as the kernel says in its fdinfo."""
    for line in open(f"/proc/self/fdinfo/{fd}"):
        if line.startswith("link_type:"):
            return line.split()[1]
    return None


@pytest.fixture
def phases(fake_nccl, tmp_path):
    src = tmp_path / "phases.c"
    src.write_text(PHASES_C)
    exe = tmp_path / "phases"
    d = fake_nccl["dir"]
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(src), f"-L{d}", "-lfakenccl",
                    f"-Wl,-rpath,{d}"], check=True)
    return exe


@pytest.mark.parametrize("storage", ["task", "hash"])
def test_a_thread_is_recorded_exactly_while_it_is_a_target(storage, fake_nccl, phases, make_cgroup,
                                                           monkeypatch, tmp_path):
    from ingero_agent.elfsyms import nccl_symbols
    from ingero_agent import probecache
    from ingero_agent.probes import ProbeConfig, Probes, task_storage_available

    if storage == "task" and not task_storage_available():
        pytest.skip("this kernel has no task-local storage for uprobe programs")
    if storage == "hash":
        monkeypatch.setenv("INGERO_UPROBE_MULTI", "0")
    cg = make_cgroup()
    cg_id = os.stat(cg).st_ino
    monkeypatch.setenv(probecache.ENV, str(tmp_path / "bpf-cache"))
    cfg = ProbeConfig(families=("nccl",), ringbuf_pages=64, self_tgid=os.getpid(), frame_storage=storage)
    first = Probes(cfg)
    first.close()
    p = Probes(cfg)
    proc = None
    try:
        assert (first.compiled, p.compiled) == ("compiled", "cached")
        assert f"-DINGERO_TASK_STORAGE={int(storage == 'task')}" in p.cflags
        st = os.stat(fake_nccl["lib"])
        attached = p.attach_library(fake_nccl["lib"], (st.st_dev, st.st_ino), nccl_symbols(fake_nccl["lib"]))
        if storage == "hash":     # one entry and one return perf event per function; noted once
            assert not p.links and len(p.bpf.uprobe_fds) == 2 * len(attached) == 42
            assert sum("uprobe_multi" in n for n in p.notes) == 1
        elif KERNEL >= (6, 6):    # a link per program: each entry's, the two return programs'
            assert p.multi_off is None and not p.bpf.uprobe_fds
            assert [_link_type(fd) for fd in p.links] == ["uretprobe_multi"] * 2 + ["uprobe_multi"] * len(attached)
        proc = subprocess.Popen([str(phases)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def phase(n: int = 5):
            proc.stdin.write(f"{n}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok"
            return p.rings["nccl"].read()

        assert len(phase()) == 0                        # phase 0: no targets
        p.set_targets(set(), {proc.pid}, set())
        got = phase()                                   # 1: the pid became a target
        assert len(got) == 5 and (got["count"] == 1001).all() and (got["pid"] == proc.pid).all()
        assert (got["stream"] == 0x5eed).all()
        p.set_targets(set(), set(), set())
        assert len(phase()) == 0                        # 2: no longer
        p.set_targets({cg_id}, set(), set())
        assert len(phase()) == 0                        # 3: its cgroup is targeted, it is not in it
        (cg / "cgroup.procs").write_text(str(proc.pid))
        got = phase()                                   # 4: it moved in (same thread, new cgroup)
        assert len(got) == 5 and (got["count"] == 1004).all() and (got["cgroup_id"] == cg_id).all()
        (cgroup2_mount() / "cgroup.procs").write_text(str(proc.pid))
        assert len(phase()) == 0                        # 5: it moved out again
        (cg / "cgroup.procs").write_text(str(proc.pid))
        p.set_targets(set(), set(), set())
        assert len(phase()) == 0                        # 6: back in, but the cgroup is no target
        assert p.lost()["nccl"] == 0
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        p.close()
