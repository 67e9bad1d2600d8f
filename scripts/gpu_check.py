"""The job of scripts/gpu-check.sh (read its header): one process, one GPU.

Run by gpu-check.sh with NCCL_PROFILER_PLUGIN and INGERO_PROFILER_FILE set; argv[1] is
the work folder. Prints a table and exits 0 (all held), 1 (a mismatch) or 2 (nothing
could be checked).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

ROUNDS = 20                  # launches of each kind: the clock fit gets pairs from each
SLEEP_CYCLES = 20_000_000    # a busy kernel before each launch: ~10 ms on an H100
P2P_BYTES = 64 << 20         # a send to self of this size runs a kernel of ~0.1-1 ms
# allowed differences, in microseconds
TOL_SPAN_US = 50             # the plugin's interval against the CUDA events around it
TOL_SPAN_SHARE = 0.10        # ... or this share of it, if more
TOL_CLOCK_US = 300           # the converted start against host issue time + event offset
NCCL_FLOAT32 = 7
NCCL_MIN = (2, 27, 0)        # profiler API v4: the first with device (kernel channel) stamps


def cannot(why: str) -> None:
    print(f"gpu-check: cannot check: {why}")
    sys.exit(2)


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def nccl_library() -> ctypes.CDLL:
    """The libnccl this process already loaded for torch (the same copy, the same plugin)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "libnccl.so" in path:
            lib = ctypes.CDLL(path)
            break
    else:
        cannot("torch's NCCL is not a shared library this process loaded (a static build?)")
    vp = ctypes.c_void_p
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), ctypes.c_int, UniqueId, ctypes.c_int]
    for fn in (lib.ncclSend, lib.ncclRecv):
        fn.argtypes = [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp]
    lib.ncclCommDestroy.argtypes = [vp]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib


def ok(lib, rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {lib.ncclGetErrorString(rc).decode()}")


def main() -> int:
    work = Path(sys.argv[1])
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        cannot(f"no torch ({e})")
    if not torch.cuda.is_available():
        cannot("torch sees no CUDA device")
    ver = torch.cuda.nccl.version()
    ver = ver if isinstance(ver, tuple) else (ver // 10000, ver // 100 % 100, ver % 100)
    print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {'.'.join(map(str, ver))}")
    if ver < NCCL_MIN:
        cannot(f"NCCL {'.'.join(map(str, ver))} loads no profiler of ours: it probes v1-v3, the plugin exports "
               "v4-v6, which carry device stamps (NCCL 2.27 and later)")
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{work / 'store'}", rank=0, world_size=1)

    # ---- torch.distributed: 1-rank collectives (NCCL copies locally: no profiler events) ----
    t = torch.ones(1 << 20, device=dev)
    out = torch.empty(1 << 20, device=dev)
    host_colls = 0
    for _ in range(3):
        dist.all_reduce(t)
        dist.all_gather_into_tensor(out, t)
        with dist._coalescing_manager(async_ops=False):
            dist.all_reduce(t)
            dist.all_reduce(out)
        host_colls += 4
    torch.cuda.synchronize()
    torch_p2p = "batch_isend_irecv to self: "
    try:
        r = torch.empty_like(t)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 0), dist.P2POp(dist.irecv, r, 0)]):
            w.wait()
        torch.cuda.synchronize()
        torch_p2p += "ran (its rows are counted below)"
    except Exception as e:            # torch refuses a peer equal to the own rank in some versions
        torch_p2p += f"refused by torch ({type(e).__name__}: {str(e)[:80]})"

    # ---- two more communicators on two streams, grouped sends and receives to self ----
    lib = nccl_library()
    comms, streams = [], [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in streams:
        uid, c = UniqueId(), ctypes.c_void_p()
        ok(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        ok(lib, lib.ncclCommInitRank(ctypes.byref(c), 1, uid, 0), "ncclCommInitRank")
        comms.append(c)
    n = P2P_BYTES // 4
    bufs = [torch.ones(n, device=dev) for _ in range(4)]
    kinds = [("pair", 0, 1), ("two pairs", 0, 2), ("pair, stream 2", 1, 1)]
    launches = []                    # (kind, comm index, ops, stream, t_issue_ns, [ev0, ev1, ev2])
    for _ in range(ROUNDS):
        for kind, ci, pairs in kinds:
            s = streams[ci]
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda.synchronize()
            t_issue = time.monotonic_ns()           # CLOCK_MONOTONIC, as the plugin's host times
            with torch.cuda.stream(s):
                evs[0].record(s)
                torch.cuda._sleep(SLEEP_CYCLES)
                evs[1].record(s)
                ok(lib, lib.ncclGroupStart(), "ncclGroupStart")
                for p in range(pairs):
                    a, b = bufs[2 * p], bufs[2 * p + 1]
                    ok(lib, lib.ncclSend(ctypes.c_void_p(a.data_ptr()), n, NCCL_FLOAT32, 0, comms[ci],
                                         ctypes.c_void_p(s.cuda_stream)), "ncclSend")
                    ok(lib, lib.ncclRecv(ctypes.c_void_p(b.data_ptr()), n, NCCL_FLOAT32, 0, comms[ci],
                                         ctypes.c_void_p(s.cuda_stream)), "ncclRecv")
                ok(lib, lib.ncclGroupEnd(), "ncclGroupEnd")
                evs[2].record(s)
            launches.append((kind, ci, 2 * pairs, s.cuda_stream, t_issue, evs))
    torch.cuda.synchronize()
    for c in comms:
        ok(lib, lib.ncclCommDestroy(c), "ncclCommDestroy")       # finalize: every record written
    dist.destroy_process_group()

    rows = [dict(w.split("=", 1) for w in line.split()[1:])
            for line in Path(os.environ["INGERO_PROFILER_FILE"]).read_text().splitlines()] \
        if Path(os.environ["INGERO_PROFILER_FILE"]).exists() else []
    if not rows:
        cannot("the plugin wrote no record: was it loaded? (NCCL_DEBUG=INFO says; NCCL_PROFILER_PLUGIN="
               f"{os.environ.get('NCCL_PROFILER_PLUGIN')})")
    return judge(rows, launches, host_colls, torch_p2p)


def judge(rows: list[dict], launches: list, host_colls: int, torch_p2p: str) -> int:
    api = sorted({r["api"] for r in rows})
    colls = [r for r in rows if r["kind"] == "coll"]
    # the communicators of our launches: in the order their first record was launched
    p2p = [r for r in rows if r["kind"] == "p2p"]
    first: dict = {}
    for r in sorted(p2p, key=lambda r: int(r["host_start"])):
        first.setdefault(r["comm"], len(first))
    ours = {}
    for ci in (0, 1):
        if api != ["4"]:          # v5+: the stream names the communicator's launches
            want = {f"0x{launches[k][3]:x}" for k in range(len(launches)) if launches[k][1] == ci}
            hashes = {r["comm"] for r in p2p if r["stream"] in want}
        else:
            hashes = {h for h, i in first.items() if i == len(first) - 2 + ci}
        ours[ci] = sorted(hashes)
    bad: list[str] = []
    stats = {k: {"n": 0, "group": 0, "stream": 0, "span": [], "clock": [], "bad": []}
             for k in dict.fromkeys(x[0] for x in launches)}
    by_comm: dict = {}
    for r in p2p:
        by_comm.setdefault(r["comm"], {}).setdefault(int(r["group"]), []).append(r)
    cursor = {ci: iter(sorted(by_comm.get(ours[ci][0], {}).items())) if len(ours[ci]) == 1 else iter(())
              for ci in (0, 1)}
    for ci in (0, 1):
        if len(ours[ci]) != 1:
            bad.append(f"communicator {ci + 1}: {len(ours[ci])} communicators carry its launches, not 1")
    for kind, ci, nops, stream, t_issue, evs in launches:
        st = stats[kind]
        st["n"] += 1
        group, ops = next(cursor[ci], (None, []))
        if len(ops) != nops:          # a launch's operations: one Group event, one group number
            st["bad"].append(f"launch with {nops} operations has {len(ops)} records in its group")
            continue
        st["group"] += 1
        if api == ["4"] or all(o["stream"] == f"0x{stream:x}" for o in ops):
            st["stream"] += 1
        else:
            st["bad"].append(f"stream {ops[0]['stream']} reported, 0x{stream:x} used")
        if any(o["dev_start_raw"] == "0" or o["dev_stop_raw"] == "0" for o in ops):
            st["bad"].append("no device stamps")
            continue
        span_us = (max(int(o["dev_stop_raw"]) for o in ops) - min(int(o["dev_start_raw"]) for o in ops)) / 1e3
        ev_us = evs[1].elapsed_time(evs[2]) * 1e3
        st["span"].append(span_us - ev_us)
        if abs(span_us - ev_us) > max(TOL_SPAN_US, TOL_SPAN_SHARE * ev_us):
            st["bad"].append(f"device interval {span_us:.0f} us, CUDA events {ev_us:.0f} us")
        start_host = min(int(o["dev_start"]) for o in ops)
        expect = t_issue + evs[0].elapsed_time(evs[1]) * 1e6   # the sleep ran from about t_issue
        st["clock"].append((start_host - expect) / 1e3)
        if not 0 <= (start_host - expect) / 1e3 <= TOL_CLOCK_US:
            st["bad"].append(f"converted start {(start_host - expect) / 1e3:+.0f} us from host issue + events")
    print(f"\nprofiler API v{', v'.join(api)}; {host_colls} one-rank collectives issued, "
          f"{len(colls)} collective records (NCCL copies a 1-rank collective locally: untimed); {torch_p2p}")
    print(f"{'launch':<16}{'n':>4}{'group':>7}{'stream':>8}{'span-ev us (med/max)':>24}"
          f"{'clock us (med/max)':>22}  result")
    for kind, st in stats.items():
        span = (f"{statistics.median(st['span']):+.1f}/{max(st['span'], key=abs):+.1f}" if st["span"] else "-")
        clock = (f"{statistics.median(st['clock']):+.1f}/{max(st['clock'], key=abs):+.1f}" if st["clock"] else "-")
        res = "ok" if not st["bad"] else f"MISMATCH: {st['bad'][0]} ({len(st['bad'])} in all)"
        print(f"{kind:<16}{st['n']:>4}{st['group']:>7}{st['stream']:>8}{span:>24}{clock:>22}  {res}")
        bad += st["bad"]
    for b in bad[:5]:
        print(f"gpu-check: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
