"""The lab's CPU NCCL library and worker: build, exported ABI, and collective correctness.

Ranks are forked processes talking over loopback TCP; no root needed.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from ingero.lab.build import build_lab_binaries

NCCL_API = {
    "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitAll", "ncclCommSplit",
    "ncclCommDestroy", "ncclCommAbort", "ncclCommCount", "ncclCommUserRank", "ncclGetErrorString",
    "ncclGetVersion", "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclBcast",
    "ncclReduce", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
}
INT8, INT32, INT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = 0, 2, 4, 6, 7, 8, 9
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
NOCOLOR = -1


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


@pytest.fixture(scope="module")
def bins(tmp_path_factory):
    return build_lab_binaries(tmp_path_factory.mktemp("cache"))


def load(path):
    lib = ctypes.CDLL(str(path))
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                           ctypes.c_int, ctypes.c_void_p]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    for name in ("ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclReduce",
                 "ncclSend", "ncclRecv", "ncclBcast"):
        getattr(lib, name).argtypes = None
    return lib


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def check(rc: int, lib, comm=None):
    assert rc == 0, f"{lib.ncclGetErrorString(rc).decode()}: {lib.ncclGetLastError(comm).decode()}"


def rank_main(libpath: str, idbytes: bytes, rank: int, n: int, q) -> None:
    """One rank: runs every collective, puts {name: result array} on q."""
    lib = load(libpath)
    uid = UniqueId.from_buffer_copy(idbytes)
    uid_b = UniqueId.from_buffer_copy(idbytes[:120] + bytes(b ^ 0x5A for b in idbytes[120:]))
    A, B = ctypes.c_void_p(), ctypes.c_void_p()
    out: dict[str, object] = {}
    check(lib.ncclCommInitRank(ctypes.byref(A), n, uid, rank), lib)
    check(lib.ncclCommInitRankConfig(ctypes.byref(B), n, uid_b, rank, None), lib)
    cnt, me = ctypes.c_int(), ctypes.c_int()
    lib.ncclCommCount(A, ctypes.byref(cnt))
    lib.ncclCommUserRank(B, ctypes.byref(me))
    out["count_rank"] = (cnt.value, me.value)
    c = ctypes.c_size_t
    cnt_elems = 1001  # not a multiple of the world size
    for name, dtype, code, op in (("f32_sum", np.float32, FLOAT32, SUM), ("f32_max", np.float32, FLOAT32, MAX),
                                  ("f32_min", np.float32, FLOAT32, MIN), ("f32_prod", np.float32, FLOAT32, PROD),
                                  ("f32_avg", np.float32, FLOAT32, AVG), ("i32_sum", np.int32, INT32, SUM),
                                  ("i64_max", np.int64, INT64, MAX), ("f64_sum", np.float64, FLOAT64, SUM),
                                  ("i8_min", np.int8, INT8, MIN), ("f16_sum", np.float16, FLOAT16, SUM)):
        send = ((np.arange(cnt_elems) % 5) + rank + 1).astype(dtype)
        recv = np.zeros_like(send)
        check(lib.ncclAllReduce(ptr(send), ptr(recv), c(cnt_elems), code, op, A, None), lib, A)
        out[name] = recv
    inplace = np.full(10, rank + 1, np.float32)
    check(lib.ncclAllReduce(ptr(inplace), ptr(inplace), c(10), FLOAT32, SUM, B, None), lib, B)
    out["inplace"] = inplace
    bf = np.full(8, 0x3F80, np.uint16)  # bfloat16 1.0
    check(lib.ncclAllReduce(ptr(bf), ptr(bf), c(8), BFLOAT16, SUM, A, None), lib, A)
    out["bf16"] = bf
    ag_in = np.full(7, rank * 10, np.int32)
    ag = np.zeros(7 * n, np.int32)
    check(lib.ncclAllGather(ptr(ag_in), ptr(ag), c(7), INT32, B, None), lib, B)
    out["allgather"] = ag
    rs_in = np.arange(5 * n, dtype=np.float32) * (rank + 1)
    rs = np.zeros(5, np.float32)
    check(lib.ncclReduceScatter(ptr(rs_in), ptr(rs), c(5), FLOAT32, SUM, A, None), lib, A)
    out["reducescatter"] = rs
    bc = np.full(100, 7 if rank == 1 else -1, np.int64)
    check(lib.ncclBroadcast(ptr(bc), ptr(bc), c(100), INT64, 1, A, None), lib, A)
    out["broadcast"] = bc
    bc2 = np.full(3, 5.5 if rank == 0 else 0, np.float64)
    check(lib.ncclBcast(ptr(bc2), c(3), FLOAT64, 0, A, None), lib, A)
    out["bcast"] = bc2
    red_in = np.full(9, rank + 2, np.float32)
    red = np.zeros(9, np.float32)
    check(lib.ncclReduce(ptr(red_in), ptr(red), c(9), FLOAT32, PROD, 2, A, None), lib, A)
    out["reduce"] = red
    # Split: ranks 0 and 1 (key reverses their order), rank 2 leaves with NOCOLOR.
    C = ctypes.c_void_p()
    color, key = (0, 10 - rank) if rank < 2 else (NOCOLOR, 0)
    check(lib.ncclCommSplit(A, color, key, ctypes.byref(C), None), lib, A)
    if C.value:
        lib.ncclCommUserRank(C, ctypes.byref(me))
        lib.ncclCommCount(C, ctypes.byref(cnt))
        s = np.full(4, float(rank), np.float32)
        check(lib.ncclAllReduce(ptr(s), ptr(s), c(4), FLOAT32, MAX, C, None), lib, C)
        out["split"] = (me.value, cnt.value, s)
        lib.ncclCommDestroy(C)
    else:
        out["split"] = None
    # Group: every rank sends 4 MiB to every other rank (more than socket buffers hold),
    # posted in an order that would deadlock if the calls ran one by one.
    big = 1 << 20
    sends = {p: np.full(big, rank * 100 + p, np.float32) for p in range(n) if p != rank}
    recvs = {p: np.zeros(big, np.float32) for p in range(n) if p != rank}
    check(lib.ncclGroupStart(), lib)
    for p in sends:
        check(lib.ncclSend(ptr(sends[p]), c(big), FLOAT32, p, A, None), lib, A)
    for p in recvs:
        check(lib.ncclRecv(ptr(recvs[p]), c(big), FLOAT32, p, A, None), lib, A)
    check(lib.ncclGroupEnd(), lib, A)
    out["p2p"] = {p: (float(r[0]), float(r[-1])) for p, r in recvs.items()}
    check(lib.ncclCommDestroy(A), lib)
    check(lib.ncclCommDestroy(B), lib)
    q.put((rank, out))


def run_ranks(libpath, n=3, target=None, extra_queues: int = 0):
    """Fork `n` ranks of `target(lib path, unique id bytes, rank, n, results queue, *extra
    queues)` (default rank_main) on a fresh unique id; {rank: what it put}, every rank exited 0."""
    lib = load(libpath)
    uid = UniqueId()
    os.environ.pop("MASTER_ADDR", None)
    os.environ.pop("NCCL_SOCKET_ADDR", None)
    os.environ["NCCL_CPU_TIMEOUT_S"] = "20"
    check(lib.ncclGetUniqueId(ctypes.byref(uid)), lib)  # this process serves the rendezvous
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    extra = [ctx.Queue() for _ in range(extra_queues)]
    procs = [ctx.Process(target=target or rank_main, args=(str(libpath), bytes(uid), r, n, q, *extra))
             for r in range(n)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=60) for _ in range(n))
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return results


def test_library_exports_the_nccl_api_and_hides_internals(bins):
    out = subprocess.run(["nm", "-D", "--defined-only", str(bins.libnccl)], capture_output=True, text=True,
                         check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert NCCL_API <= exported
    assert not {s for s in exported if s.startswith("ncpu_")}
    soname = subprocess.run(["readelf", "-d", str(bins.libnccl)], capture_output=True, text=True).stdout
    assert "[libnccl.so.2]" in soname
    ldd = subprocess.run(["ldd", str(bins.worker)], capture_output=True, text=True).stdout
    assert f"libnccl.so.2 => {bins.libnccl}" in ldd


def test_build_is_reused_from_the_cache(bins, tmp_path_factory):
    again = build_lab_binaries(bins.dir.parent.parent)
    assert again == bins
    assert again.libnccl.stat().st_mtime == bins.libnccl.stat().st_mtime


def test_collectives_split_and_group_p2p_give_correct_results_over_tcp(bins):
    n = 3
    res = run_ranks(bins.libnccl, n)
    base = np.arange(1001) % 5
    per_rank = [base + r + 1 for r in range(n)]
    for r in range(n):
        o = res[r]
        assert o["count_rank"] == (n, r)
        np.testing.assert_array_equal(o["f32_sum"], sum(per_rank).astype(np.float32))
        np.testing.assert_array_equal(o["f32_max"], per_rank[-1].astype(np.float32))
        np.testing.assert_array_equal(o["f32_min"], per_rank[0].astype(np.float32))
        np.testing.assert_array_equal(o["f32_prod"], np.prod(per_rank, axis=0).astype(np.float32))
        np.testing.assert_allclose(o["f32_avg"], (sum(per_rank) / n).astype(np.float32), rtol=1e-6)
        np.testing.assert_array_equal(o["i32_sum"], sum(per_rank).astype(np.int32))
        np.testing.assert_array_equal(o["i64_max"], per_rank[-1])
        np.testing.assert_array_equal(o["f64_sum"], sum(per_rank).astype(np.float64))
        np.testing.assert_array_equal(o["i8_min"], per_rank[0].astype(np.int8))
        np.testing.assert_array_equal(o["f16_sum"], sum(per_rank).astype(np.float16))
        np.testing.assert_array_equal(o["inplace"], np.full(10, 6, np.float32))
        assert set(o["bf16"].tolist()) == {0x4040}  # bfloat16 3.0
        np.testing.assert_array_equal(o["allgather"], np.repeat(np.arange(n) * 10, 7))
        full = np.arange(5 * n, dtype=np.float32) * sum(range(1, n + 1))
        np.testing.assert_array_equal(o["reducescatter"], full[5 * r:5 * r + 5])
        assert set(o["broadcast"].tolist()) == {7}
        assert set(o["bcast"].tolist()) == {5.5}
        assert o["p2p"] == {p: (float(p * 100 + r),) * 2 for p in range(n) if p != r}
    np.testing.assert_array_equal(res[2]["reduce"], np.full(9, 2 * 3 * 4, np.float32))
    # split: key 10-rank puts parent rank 1 first; rank 2 had NOCOLOR
    assert res[0]["split"][:2] == (1, 2) and res[1]["split"][:2] == (0, 2)
    np.testing.assert_array_equal(res[0]["split"][2], np.full(4, 1.0, np.float32))
    assert res[2]["split"] is None


def test_init_rank_rejects_an_id_it_did_not_make(bins):
    lib = load(bins.libnccl)
    comm = ctypes.c_void_p()
    rc = lib.ncclCommInitRank(ctypes.byref(comm), 2, UniqueId(), 0)
    assert rc == 4  # ncclInvalidArgument
    assert lib.ncclGetErrorString(rc).startswith(b"invalid argument")
    version = ctypes.c_int()
    assert lib.ncclGetVersion(ctypes.byref(version)) == 0 and version.value == 21903


def worker_env(rank, n, port, **extra):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank % 2),
               LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="test", INGERO_LAB_COMPUTE_MS="5",
               INGERO_LAB_CPU_MS="1", INGERO_LAB_ELEMS="65536")
    env.update(extra)
    return env


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_ranks_run_the_same_steps_and_report_json(bins):
    import json
    n, port = 3, free_port()
    procs = [subprocess.Popen([str(bins.worker)], env=worker_env(r, n, port, INGERO_LAB_STEPS="12"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e for _, e in outs]
    finals = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert [f["steps"] for f in finals] == [12] * n
    assert all(f["verified"] and f["mean_step_ms"] >= 6 for f in finals)


def test_worker_exits_with_a_message_when_a_peer_dies(bins):
    n, port = 3, free_port()
    procs = [subprocess.Popen([str(bins.worker)], env=worker_env(r, n, port, INGERO_LAB_SECONDS="60",
                                                                 INGERO_LAB_TIMEOUT_S="5"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    time.sleep(1.5)
    procs[2].send_signal(signal.SIGKILL)
    start = time.monotonic()
    errs = [p.communicate(timeout=30)[1] for p in procs[:2]]
    procs[2].wait()
    assert time.monotonic() - start < 15
    assert all(p.returncode == 3 for p in procs[:2])
    assert any("rank 2" in e for e in errs), errs


def test_init_all_comms_reduce_together_inside_one_group_from_one_thread(bins):
    lib = load(bins.libnccl)
    n = 3
    comms = (ctypes.c_void_p * n)()
    check(lib.ncclCommInitAll(comms, n, None), lib)
    bufs = [np.full(50_000, r + 1, np.float32) for r in range(n)]
    check(lib.ncclGroupStart(), lib)
    for r in range(n):
        check(lib.ncclAllReduce(ptr(bufs[r]), ptr(bufs[r]), ctypes.c_size_t(50_000), FLOAT32, SUM,
                                ctypes.c_void_p(comms[r]), None), lib)
    check(lib.ncclGroupEnd(), lib)
    for r in range(n):
        assert set(bufs[r].tolist()) == {6.0}
        check(lib.ncclCommDestroy(ctypes.c_void_p(comms[r])), lib)
