"""Calls in flight read from the NCCL probes' per-thread slots (agent/ingero_agent/inflight.py),
with both slot storages: 16 threads blocked inside a probed ncclAllReduce are all seen."""

from __future__ import annotations

import os

import pytest

from bench.common import compile_c
from bench.inflight_cost import _one


@pytest.mark.parametrize("storage", ["task", "hash"])
def test_every_thread_blocked_inside_a_call_is_seen_in_flight(tmp_path, storage):
    from ingero_agent.probes import task_storage_available

    if storage == "task" and not task_storage_available():
        pytest.skip("no task-local storage on this kernel")
    if storage == "task" and tuple(int(x) for x in os.uname().release.split(".")[:2]) < (6, 9):
        pytest.skip("a pidfd of a thread (PIDFD_THREAD) needs Linux 6.9")
    lib = compile_c(tmp_path / "libnccl_block.so", ["nccl_block.c"], shared=True)
    loop = compile_c(tmp_path / "inflight_threads", ["inflight_threads.c"], libs=("-ldl", "-lpthread"))
    r = _one(storage, loop, lib, threads=16, rounds=3)
    assert r["threads"] == 17 and r["open_calls_seen"] == 16, r
