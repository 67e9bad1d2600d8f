"""One rank of a tests/unit/test_lab_gpu_device.py scenario, in a process of its own.

    python tests/unit/lab_rank.py SCENARIO LIBNCCL RANK NRANKS UNIQUE_ID_HEX

Loads the lab's libnccl.so.2 with ctypes (the device mode comes from
INGERO_LAB_DEVICE in the environment, read once per process: hence a process
per rank), runs SCENARIO and prints one JSON line of what it saw.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np

FLOAT32, SUM = 7, 0
IN_PROGRESS = 7


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
    """ncclConfig_t of NCCL 2.19 (ingero/lab/csrc/nccl.h)."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


def config(blocking: int) -> Config:
    undef = -2**31
    return Config(ctypes.sizeof(Config), 0xCAFEBEEF, 21903, blocking, undef, undef, undef, None, undef)


def load(path: str):
    lib = ctypes.CDLL(path)
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int,
                                           ctypes.POINTER(Config)]
    lib.labLaunchKernel.argtypes = [ctypes.c_double, ctypes.c_void_p]
    lib.ncclGetLastError.restype = ctypes.c_char_p
    for name in ("ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclSend", "ncclRecv"):
        getattr(lib, name).argtypes = None
    return lib


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def ok(rc: int, lib, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"{what} returned {rc}: {lib.ncclGetLastError(None).decode()}")


def state(lib, comm) -> int:
    s = ctypes.c_int()
    ok(lib.ncclCommGetAsyncError(comm, ctypes.byref(s)), lib, "ncclCommGetAsyncError")
    return s.value


def settle(lib, comm, timeout: float = 60.0) -> int:
    """Polls ncclCommGetAsyncError until it is not ncclInProgress; returns it. Still in
    progress after `timeout` (a machine at load 30 gives each process ~1/15 of a core): an
    exit that says so, not a misuse error from the call after it."""
    end = time.monotonic() + timeout
    while (s := state(lib, comm)) == IN_PROGRESS:
        if time.monotonic() > end:
            raise SystemExit(f"the communicator is still in progress after {timeout:g} s")
        time.sleep(0.001)
    return s


def allreduce(lib, comm, rank: int, n: int = 1000) -> tuple[np.ndarray, int]:
    a = np.full(n, rank + 1, np.float32)
    rc = lib.ncclAllReduce(ptr(a), ptr(a), ctypes.c_size_t(n), FLOAT32, SUM, comm, None)
    return a, rc


def scenario_async(lib, uid, rank, n) -> dict:
    """A 300 ms kernel, then an all-reduce: when each call returned, what the buffer held then."""
    comm = ctypes.c_void_p()
    ok(lib.ncclCommInitRank(ctypes.byref(comm), n, uid, rank), lib, "ncclCommInitRank")
    send, recv = np.full(1000, rank + 1, np.float32), np.zeros(1000, np.float32)
    t0 = time.monotonic()
    ok(lib.labLaunchKernel(300.0, None), lib, "labLaunchKernel")
    t1 = time.monotonic()
    ok(lib.ncclAllReduce(ptr(send), ptr(recv), ctypes.c_size_t(1000), FLOAT32, SUM, comm, None), lib, "ncclAllReduce")
    t2 = time.monotonic()
    before = float(recv[0])
    ok(lib.labStreamSynchronize(None), lib, "labStreamSynchronize")
    t3 = time.monotonic()
    ok(lib.ncclCommDestroy(comm), lib, "ncclCommDestroy")
    return {"launch_ms": (t1 - t0) * 1e3, "call_ms": (t2 - t1) * 1e3, "total_ms": (t3 - t0) * 1e3,
            "before": before, "after": float(recv[0]), "async": lib.labDeviceAsync()}


def scenario_nonblocking(lib, uid, rank, n) -> dict:
    """Non-blocking init, collective and split; rank 1 comes 0.5 s late to init and split."""
    out: dict = {}
    cfg = config(0)
    A, C = ctypes.c_void_p(), ctypes.c_void_p()
    if rank == 1:
        time.sleep(0.5)
    out["init_rc"] = lib.ncclCommInitRankConfig(ctypes.byref(A), n, uid, rank, ctypes.byref(cfg))
    out["init_handle"] = bool(A.value)
    out["init_state"] = state(lib, A)
    _, out["early_rc"] = allreduce(lib, A, rank)
    out["init_settled"] = settle(lib, A)
    a, out["coll_rc"] = allreduce(lib, A, rank)
    out["coll_settled"] = settle(lib, A)
    ok(lib.labStreamSynchronize(None), lib, "labStreamSynchronize")
    out["coll_value"] = float(a[0])
    if rank == 1:
        time.sleep(0.5)
    out["split_rc"] = lib.ncclCommSplit(A, 0, n - rank, ctypes.byref(C), None)
    out["split_child"] = bool(C.value)
    out["split_state"] = state(lib, A)
    time.sleep(0.2)
    out["split_child_later"] = bool(C.value)
    out["split_settled"] = settle(lib, A)
    out["child"] = bool(C.value)
    out["child_state"] = state(lib, C)
    rank_in_c = ctypes.c_int()
    lib.ncclCommUserRank(C, ctypes.byref(rank_in_c))
    out["child_rank"] = rank_in_c.value
    b, out["child_coll_rc"] = allreduce(lib, C, rank)
    out["child_coll_settled"] = settle(lib, C)
    me = rank_in_c.value   # a ring in the child's numbering, carrying parent ranks
    s, r = np.full(64, rank, np.float32), np.zeros(64, np.float32)
    lib.ncclGroupStart()
    ok(lib.ncclSend(ptr(s), ctypes.c_size_t(64), FLOAT32, (me + 1) % n, C, None), lib, "ncclSend")
    ok(lib.ncclRecv(ptr(r), ctypes.c_size_t(64), FLOAT32, (me - 1) % n, C, None), lib, "ncclRecv")
    out["group_rc"] = lib.ncclGroupEnd()
    out["group_settled"] = settle(lib, C)
    ok(lib.labStreamSynchronize(None), lib, "labStreamSynchronize")
    out["child_value"], out["p2p_value"] = float(b[0]), float(r[0])
    ok(lib.ncclCommDestroy(C), lib, "ncclCommDestroy")
    ok(lib.ncclCommDestroy(A), lib, "ncclCommDestroy")
    return out


def scenario_profile(lib, uid, rank, n) -> dict:
    """Init, split; a 200 ms kernel, then AllReduce x2, AllGather, Broadcast (on the split),
    a Send/Recv ring in a group, a ReduceScatter and an AllGather coalesced in a group; sync;
    destroy (see test_lab_gpu_device.py)."""
    A, C = ctypes.c_void_p(), ctypes.c_void_p()
    ok(lib.ncclCommInitRank(ctypes.byref(A), n, uid, rank), lib, "ncclCommInitRank")
    ok(lib.ncclCommSplit(A, 0, rank, ctypes.byref(C), None), lib, "ncclCommSplit")
    ok(lib.labLaunchKernel(200.0, None), lib, "labLaunchKernel")
    a1, rc = allreduce(lib, A, rank, 100_000)
    ok(rc, lib, "ncclAllReduce")
    a2, rc = allreduce(lib, A, rank, 10)
    ok(rc, lib, "ncclAllReduce")
    ag_in, ag = np.full(5, rank, np.float32), np.zeros(5 * n, np.float32)
    ok(lib.ncclAllGather(ptr(ag_in), ptr(ag), ctypes.c_size_t(5), FLOAT32, A, None), lib, "ncclAllGather")
    bc = np.full(3, 9 if rank == 0 else 0, np.float32)
    ok(lib.ncclBroadcast(ptr(bc), ptr(bc), ctypes.c_size_t(3), FLOAT32, 0, C, None), lib, "ncclBroadcast")
    s, r = np.full(64, rank, np.float32), np.zeros(64, np.float32)
    lib.ncclGroupStart()
    ok(lib.ncclSend(ptr(s), ctypes.c_size_t(64), FLOAT32, (rank + 1) % n, A, None), lib, "ncclSend")
    ok(lib.ncclRecv(ptr(r), ctypes.c_size_t(64), FLOAT32, (rank - 1) % n, A, None), lib, "ncclRecv")
    ok(lib.ncclGroupEnd(), lib, "ncclGroupEnd")
    rs_in, rs = np.full(4 * n, rank + 1, np.float32), np.zeros(4, np.float32)
    ag2 = np.zeros(4 * n, np.float32)
    lib.ncclGroupStart()
    ok(lib.ncclReduceScatter(ptr(rs_in), ptr(rs), ctypes.c_size_t(4), FLOAT32, SUM, A, None), lib, "ncclReduceScatter")
    ok(lib.ncclAllGather(ptr(rs_in), ptr(ag2), ctypes.c_size_t(4), FLOAT32, A, None), lib, "ncclAllGather")
    ok(lib.ncclGroupEnd(), lib, "ncclGroupEnd")
    ok(lib.labStreamSynchronize(None), lib, "labStreamSynchronize")
    ok(lib.ncclCommDestroy(C), lib, "ncclCommDestroy")
    ok(lib.ncclCommDestroy(A), lib, "ncclCommDestroy")
    want = n * (n + 1) / 2
    return {"verified": bool(a1[0] == want and a2[-1] == want and ag[-1] == n - 1 and bc[0] == 9
                             and r[0] == (rank - 1) % n and rs[0] == want and ag2[-1] == n)}


def scenario_streams(lib, uid, rank, n) -> dict:
    """Communicators A and C (a split), each on a stream of its own: a 300 ms kernel, then an
    all-reduce, on A's stream; an all-reduce on C's stream at once (beside the kernel); then
    C's stream made to wait for A's, and a second all-reduce on C. When each stream's sync
    returned, from the first launch on."""
    A, C = ctypes.c_void_p(), ctypes.c_void_p()
    ok(lib.ncclCommInitRank(ctypes.byref(A), n, uid, rank), lib, "ncclCommInitRank")
    ok(lib.ncclCommSplit(A, 0, rank, ctypes.byref(C), None), lib, "ncclCommSplit")
    sa, sc = ctypes.c_void_p(), ctypes.c_void_p()
    ok(lib.labStreamCreate(ctypes.byref(sa)), lib, "labStreamCreate")
    ok(lib.labStreamCreate(ctypes.byref(sc)), lib, "labStreamCreate")
    a, c1, c2 = (np.full(1000, rank + 1, np.float32) for _ in range(3))
    t0 = time.monotonic()
    ok(lib.labLaunchKernel(ctypes.c_double(300.0), sa), lib, "labLaunchKernel")
    ok(lib.ncclAllReduce(ptr(a), ptr(a), ctypes.c_size_t(1000), FLOAT32, SUM, A, sa), lib, "ncclAllReduce")
    ok(lib.ncclAllReduce(ptr(c1), ptr(c1), ctypes.c_size_t(1000), FLOAT32, SUM, C, sc), lib, "ncclAllReduce")
    ok(lib.labStreamSynchronize(sc), lib, "labStreamSynchronize")
    t_c = time.monotonic()
    a_then = float(a[0])
    ok(lib.labStreamWaitStream(sc, sa), lib, "labStreamWaitStream")
    ok(lib.ncclAllReduce(ptr(c2), ptr(c2), ctypes.c_size_t(1000), FLOAT32, SUM, C, sc), lib, "ncclAllReduce")
    ok(lib.labStreamSynchronize(sc), lib, "labStreamSynchronize")
    t_w = time.monotonic()
    ok(lib.labDeviceSynchronize(), lib, "labDeviceSynchronize")
    ok(lib.ncclCommDestroy(C), lib, "ncclCommDestroy")
    ok(lib.ncclCommDestroy(A), lib, "ncclCommDestroy")
    want = n * (n + 1) / 2
    return {"c_ms": (t_c - t0) * 1e3, "waited_ms": (t_w - t0) * 1e3, "a_when_c_done": a_then,
            "verified": bool(a[0] == want and c1[0] == want and c2[-1] == want)}


def main() -> None:
    scenario, path, rank, n, uid_hex = sys.argv[1:6]
    lib = load(path)
    uid = UniqueId.from_buffer_copy(bytes.fromhex(uid_hex))
    fn = {"async": scenario_async, "nonblocking": scenario_nonblocking, "profile": scenario_profile,
          "streams": scenario_streams}[scenario]
    print(json.dumps(fn(lib, uid, int(rank), int(n))), flush=True)


if __name__ == "__main__":
    main()
