"""The lab's CPU NCCL implements the newer entry points with real data movement:
ncclCommInitRankScalable, ncclAlltoAll, ncclGather, ncclScatter,
ncclGroupSimulateEnd and ncclCommShrink (signatures from NVIDIA's nccl.h.in);
and the lab worker builds its world with ncclCommInitRankScalable above
TORCH_NCCL_RANKS_PER_ROOT, as PyTorch does."""

from __future__ import annotations

import ctypes
import json
import subprocess

import numpy as np
import pytest

from tests.unit.test_lab_build import FLOAT32, INT32, UniqueId, bins, check, free_port, ptr, run_ranks, worker_env  # noqa: F401


class SimInfo(ctypes.Structure):   # ncclSimInfo_v22200
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("estimatedTime", ctypes.c_float)]


def _rank(libpath: str, idbytes: bytes, rank: int, n: int, q) -> None:
    lib = ctypes.CDLL(libpath)
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    c = ctypes.c_size_t
    ids = (UniqueId * 2)(UniqueId.from_buffer_copy(idbytes), UniqueId.from_buffer_copy(bytes(128)))
    W = ctypes.c_void_p()
    check(lib.ncclCommInitRankScalable(ctypes.byref(W), n, rank, 2, ids, None), lib)
    out = {}
    k = 5
    send = np.array([rank * 100 + p for p in range(n) for _ in range(k)], np.int32)
    recv = np.zeros(n * k, np.int32)
    check(lib.ncclAlltoAll(ptr(send), ptr(recv), c(k), INT32, W, None), lib, W)
    out["alltoall"] = recv.reshape(n, k)[:, 0].tolist()
    mine = np.full(k, float(rank), np.float32)
    gathered = np.full(n * k, -1, np.float32)
    check(lib.ncclGather(ptr(mine), ptr(gathered), c(k), FLOAT32, 1, W, None), lib, W)
    out["gather"] = gathered.reshape(n, k)[:, -1].tolist()
    src = np.repeat(np.arange(n, dtype=np.float32) * 7, k) if rank == 0 else np.zeros(n * k, np.float32)
    got = np.zeros(k, np.float32)
    check(lib.ncclScatter(ptr(src), ptr(got), c(k), FLOAT32, 0, W, None), lib, W)
    out["scatter"] = got.tolist()
    # GroupSimulateEnd closes the group and launches nothing: the buffer stays as it was
    sim = SimInfo(ctypes.sizeof(SimInfo), 0x74685283, 21903, -1.0)
    untouched = np.full(1000, 1.0, np.float32)
    check(lib.ncclGroupStart(), lib)
    check(lib.ncclAllReduce(ptr(untouched), ptr(untouched), c(1000), FLOAT32, 0, W, None), lib, W)
    check(lib.ncclGroupSimulateEnd(ctypes.byref(sim)), lib)
    out["simulate"] = (float(untouched[0]), sim.estimatedTime > 0)
    # Shrink: rank 0 is excluded and does not call; the others are renumbered
    if rank != 0:
        S = ctypes.c_void_p()
        excl = (ctypes.c_int * 1)(0)
        check(lib.ncclCommShrink(W, excl, 1, ctypes.byref(S), None, 0), lib, W)
        me, cnt = ctypes.c_int(), ctypes.c_int()
        lib.ncclCommUserRank(S, ctypes.byref(me))
        lib.ncclCommCount(S, ctypes.byref(cnt))
        v = np.full(3, float(rank), np.float32)
        check(lib.ncclAllReduce(ptr(v), ptr(v), c(3), FLOAT32, 0, S, None), lib, S)
        out["shrink"] = (me.value, cnt.value, float(v[0]))
        lib.ncclCommDestroy(S)
    check(lib.ncclCommDestroy(W), lib)
    q.put((rank, out))


def test_scalable_init_alltoall_gather_scatter_simulate_and_shrink_move_the_right_data(bins):
    n = 3
    res = run_ranks(bins.libnccl, n, target=_rank)
    for r in range(n):
        assert res[r]["alltoall"] == [p * 100 + r for p in range(n)]
        assert res[r]["scatter"] == [7.0 * r] * 5
        assert res[r]["simulate"] == (1.0, True)
    assert res[1]["gather"] == [0.0, 1.0, 2.0]
    assert res[0]["gather"] == [-1.0] * n           # not the root: recvbuff unused
    assert "shrink" not in res[0]
    assert res[1]["shrink"] == (0, 2, 3.0) and res[2]["shrink"] == (1, 2, 3.0)


def test_library_exports_the_newer_entry_points(bins):
    out = subprocess.run(["nm", "-D", "--defined-only", str(bins.libnccl)], capture_output=True,
                         text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {"ncclCommInitRankScalable", "ncclAlltoAll", "ncclGather", "ncclScatter",
            "ncclGroupSimulateEnd", "ncclCommShrink"} <= names


@pytest.mark.parametrize("per_root", ["2", "128"])
def test_worker_above_ranks_per_root_inits_scalably_and_verifies_the_newer_collectives(bins, per_root):
    n, port = 3, free_port()
    extra = dict(INGERO_LAB_STEPS="4", TORCH_NCCL_RANKS_PER_ROOT=per_root, INGERO_LAB_NEWER_COLLECTIVES="1")
    procs = [subprocess.Popen([str(bins.worker)], env=worker_env(r, n, port, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e for _, e in outs]
    assert [json.loads(o.strip().splitlines()[-1])["steps"] for o, _ in outs] == [4] * n
