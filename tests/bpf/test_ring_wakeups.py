"""The tracer sleeps until there is work: rings wake it at a watermark, an exec
by a target process wakes it for a quick scan, and a burst many rings long is
still drained without loss (real eBPF, fake NCCL library)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from ingero_agent.cgroups import cgroup_id
from ingero_agent.probes import ProbeConfig, Probes
from ingero_agent.records import NCCL_EVENT, ringbuf_dtype
from ingero_agent.ringbuf import RingWaiter

from tests.bpf.conftest import FIXTURES, drive, nccl_probes, spawn

OTHER_CALLS = 19   # calls the driver makes besides its ITERS all-reduces


def test_a_ring_wakes_the_reader_only_once_a_quarter_of_it_is_unread(fake_nccl, tmp_path):
    p = nccl_probes(fake_nccl, pages=16)      # 64 KiB: 585 NCCL records, wakes at 146
    waiter = RingWaiter([p.rings["nccl"]])     # this ring only (not the exec notes)
    try:
        assert p.wake_records["nccl"] == 16 * 4096 // ringbuf_dtype(NCCL_EVENT).itemsize // 4 == 146
        p.arm_wakeup("nccl")
        waiter.wait(0)                         # nothing pending from set-up
        drive(p, fake_nccl, tmp_path, 100)    # 119 records: below the watermark
        assert p.produced("nccl") == 100 + OTHER_CALLS
        assert not waiter.wait(0.3)            # no wake-up: the records just sit there
        drive(p, fake_nccl, tmp_path, 30)     # 149 in all: past it
        assert waiter.wait(5.0)
        assert len(p.rings["nccl"].read()) == 130 + 2 * OTHER_CALLS
        p.arm_wakeup("nccl")                   # re-armed after the drain: quiet again
        drive(p, fake_nccl, tmp_path, 100)
        assert not waiter.wait(0.3)
        assert p.lost()["nccl"] == 0
    finally:
        waiter.close()
        p.close()


def test_an_exec_by_a_target_process_is_noted_at_once(make_cgroup):
    p = Probes(ProbeConfig(families=("sched",), self_tgid=os.getpid()))
    try:
        assert p.exec_notes is not None, p.notes
        cg = make_cgroup()
        p.set_targets({cgroup_id(cg)}, set(), set())
        p.arm_wakeup("sched")
        p.waiter.wait(0)
        outside = spawn(["true"])
        assert outside.wait(10) == 0
        inside = spawn(["true"], cgroup=cg)    # sh moves itself into the cgroup, then execs true
        assert inside.wait(10) == 0
        assert p.waiter.wait(5.0)
        noted = p.exec_notes.read().tolist()
        assert inside.pid in noted and outside.pid not in noted
    finally:
        p.close()


@pytest.fixture(scope="module")
def burst(fake_nccl) -> str:
    """A program that calls the fake ncclSend (which returns at once) N times in a row."""
    exe = fake_nccl["dir"] / "burst"
    if not exe.exists():
        subprocess.run(["gcc", "-O1", "-o", str(exe), str(FIXTURES / "burst.c"),
                        f"-L{fake_nccl['dir']}", "-lfakenccl", f"-Wl,-rpath,{fake_nccl['dir']}"],
                       check=True)
    return str(exe)


def test_a_burst_many_rings_long_is_drained_by_wakeups_without_loss(fake_nccl, burst, trace,
                                                                    make_cgroup, tmp_path):
    # The agent's default ring (8 MiB), and segments rolled rarely, so that draining only at
    # rolls could not hold the burst however slowly a busy machine runs it.
    pages, calls, roll_s = 2048, 600_000, 30.0
    capacity = pages * 4096 // ringbuf_dtype(NCCL_EVENT).itemsize    # 74,898 records
    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "nccl", "--nccl-lib", str(fake_nccl["lib"]),
              "--ringbuf-pages", str(pages), "--segment-seconds", str(roll_s), "--quiet")
    go = tmp_path / "go"
    t0 = time.monotonic()
    drv = spawn([burst, str(calls), str(go)], cgroup=cg)
    go.touch()
    assert drv.wait(120) == 0, drv.stderr.read()
    elapsed = time.monotonic() - t0
    t.stop()
    assert t.query("SELECT events_nccl, lost_nccl FROM nodes") == [(calls, 0)]
    assert t.query("SELECT COUNT(DISTINCT count) FROM nccl_events WHERE op = 'SEND'") == [(calls,)]
    # Draining only at segment rolls would have kept at most one ring per roll.
    assert calls > capacity * (elapsed / roll_s + 2), (elapsed, capacity)
