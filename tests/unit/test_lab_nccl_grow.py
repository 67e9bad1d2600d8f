"""The lab's CPU NCCL grows communicators as NVIDIA's ncclCommGrow does (nccl.h.in,
2.29): the coordinator takes a grow id from ncclCommGetUniqueId and passes it, the
other existing ranks pass NULL and keep their rank, new ranks pass the id and their
rank; the grown communicator moves real data. The lab worker's elastic mode
(`ingero lab run --elastic`) shrinks its world, grows it back and checks every
buffer, on both devices and with non-blocking communicators."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

from tests.unit.test_lab_build import FLOAT32, UniqueId, bins, check, free_port, ptr, run_ranks, worker_env  # noqa: F401

NCCL_INVALID_ARGUMENT = 4


def _rank(libpath: str, idbytes: bytes, rank: int, n: int, q, grow_q) -> None:
    """World of n; rank n-1 is left out of the shrink and joins the grow as a new rank."""
    lib = ctypes.CDLL(libpath)
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    c = ctypes.c_size_t
    W, S, G = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(lib.ncclCommInitRank(ctypes.byref(W), n, UniqueId.from_buffer_copy(idbytes), rank), lib)
    out = {}
    gid = UniqueId()
    if rank != n - 1:
        excl = (ctypes.c_int * 1)(n - 1)
        check(lib.ncclCommShrink(W, excl, 1, ctypes.byref(S), None, 0), lib, W)
        # an existing rank must pass rank -1; a grow must add ranks
        out["bad_rank"] = lib.ncclCommGrow(S, n, None, 0, ctypes.byref(G), None)
        out["bad_size"] = lib.ncclCommGrow(S, n - 1, None, -1, ctypes.byref(G), None)
        if rank == 0:                                   # the coordinator
            check(lib.ncclCommGetUniqueId(S, ctypes.byref(gid)), lib, S)
            grow_q.put(bytes(gid))
            check(lib.ncclCommGrow(S, n, ctypes.byref(gid), -1, ctypes.byref(G), None), lib, S)
        else:
            check(lib.ncclCommGrow(S, n, None, -1, ctypes.byref(G), None), lib, S)
    else:
        out["no_id"] = lib.ncclCommGrow(None, n, None, n - 1, ctypes.byref(G), None)
        gid = UniqueId.from_buffer_copy(grow_q.get(timeout=30))
        check(lib.ncclCommGrow(None, n, ctypes.byref(gid), n - 1, ctypes.byref(G), None), lib)
    me, cnt = ctypes.c_int(), ctypes.c_int()
    lib.ncclCommUserRank(G, ctypes.byref(me))
    lib.ncclCommCount(G, ctypes.byref(cnt))
    v = np.full(5, float(me.value + 1), np.float32)
    check(lib.ncclAllReduce(ptr(v), ptr(v), c(5), FLOAT32, 0, G, None), lib, G)
    out["grown"] = (me.value, cnt.value, float(v[0]))
    for comm in (G, S, W):
        if comm.value:
            check(lib.ncclCommDestroy(comm), lib)
    q.put((rank, out))


def test_grow_joins_existing_and_new_ranks_into_one_communicator_that_moves_data(bins):
    n = 3
    res = run_ranks(bins.libnccl, n, target=_rank, extra_queues=1)
    total = float(n * (n + 1) // 2)
    # existing ranks keep their rank; the new one is the rank it asked for
    assert [res[r]["grown"] for r in range(n)] == [(r, n, total) for r in range(n)]
    assert res[0]["bad_rank"] == res[0]["bad_size"] == NCCL_INVALID_ARGUMENT
    assert res[n - 1]["no_id"] == NCCL_INVALID_ARGUMENT


def test_library_exports_grow_and_its_unique_id(bins):
    out = subprocess.run(["nm", "-D", "--defined-only", str(bins.libnccl)], capture_output=True,
                         text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {"ncclCommGrow", "ncclCommGetUniqueId"} <= names


@pytest.mark.parametrize("device,nonblocking", [("cpu", "0"), ("gpu", "0"), ("cpu", "1")],
                         ids=["cpu", "gpu", "nonblocking"])
def test_worker_elastic_shrinks_grows_back_and_checks_every_buffer(bins, device, nonblocking):
    n, port = 3, free_port()
    extra = dict(INGERO_LAB_STEPS="2", INGERO_LAB_ELASTIC="1", INGERO_LAB_ELASTIC_STEPS="2",
                 INGERO_LAB_DEVICE=device, INGERO_LAB_NONBLOCKING=nonblocking, INGERO_LAB_TIMEOUT_S="30")
    procs = [subprocess.Popen([str(bins.worker)], env=worker_env(r, n, port, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e for _, e in outs]
    lines = [[ln for ln in o.splitlines() if "elastic:" in ln] for o, _ in outs]
    assert all(len(ls) == 1 for ls in lines), outs
    assert "waited, as the excluded rank 1" in lines[1][0] and "(rank 2)" in lines[1][0]
    assert "shrunk without rank 1" in lines[2][0] and "(rank 1)" in lines[2][0]


def test_worker_elastic_needs_two_ranks_and_no_layout(bins):
    p = subprocess.run([str(bins.worker)], env=worker_env(0, 1, free_port(), INGERO_LAB_ELASTIC="1"),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "INGERO_LAB_ELASTIC needs" in p.stderr
