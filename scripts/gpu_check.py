"""The job of scripts/gpu-check.sh (read its header): one process.

Run by gpu-check.sh with NCCL_PROFILER_PLUGIN and INGERO_PROFILER_FILE set; argv[1] is
the work folder. Prints a table and exits 0 (all held), 1 (a mismatch) or 2 (nothing
could be checked).

What NCCL profiles decides the shape. A 1-rank communicator runs its collectives as a
local copy (enqueue.cc: ncclLaunchOneRank) and its sends to self with no proxy operation,
so neither ever reaches a profiler's kernel-channel events. The operations checked here
therefore run on 2-rank communicators made by ncclCommInitAll in this one process: on
two GPUs, or on one GPU from NCCL 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1, which gpu-check.sh
sets; older NCCL refuses two ranks on one GPU). Each rank of each communicator has a CUDA
stream of its own. torch.distributed (world size 1) runs all-reduce, all-gather, a
coalesced launch and batch_isend_irecv to itself, which are counted and said to be
untimed.
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
ELEMS = 16 << 20             # float32 elements per buffer (64 MiB): kernels of ~0.1-1 ms
# allowed differences, in microseconds
TOL_SPAN_US = 50             # the plugin's interval against the CUDA events around it
TOL_SPAN_SHARE = 0.10        # ... or this share of it, if more
TOL_CLOCK_US = 300           # the converted start against host issue time + event offset
NCCL_FLOAT32, NCCL_SUM = 7, 0
NCCL_MIN = (2, 27, 0)        # profiler API v4: the first with device (kernel channel) stamps
NCCL_SAME_GPU = (2, 30, 0)   # NCCL_MULTI_RANK_GPU_ENABLE: two ranks on one GPU


def cannot(why: str) -> None:
    print(f"gpu-check: cannot check: {why}")
    sys.exit(2)


def nccl_library() -> ctypes.CDLL:
    """The libnccl this process already loaded for torch (the same copy, the same plugin)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        f = line.split()
        if len(f) >= 6 and "libnccl.so" in f[-1]:
            lib = ctypes.CDLL(f[-1])
            break
    else:
        cannot("torch's NCCL is not a shared library this process loaded (a static build?)")
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lib.ncclCommInitAll.argtypes = [ctypes.POINTER(vp), i, ctypes.POINTER(i)]
    lib.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
    lib.ncclReduceScatter.argtypes = [vp, vp, sz, i, i, vp, vp]
    lib.ncclAllGather.argtypes = [vp, vp, sz, i, vp, vp]
    lib.ncclSend.argtypes = [vp, sz, i, i, vp, vp]
    lib.ncclRecv.argtypes = [vp, sz, i, i, vp, vp]
    lib.ncclCommDestroy.argtypes = [vp]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib


def ok(lib, rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {lib.ncclGetErrorString(rc).decode()}")


def torch_collectives(dist, torch, dev, work: Path) -> tuple[int, str]:
    """torch.distributed, world size 1: the calls a job makes, none of them profiled."""
    dist.init_process_group("nccl", init_method=f"file://{work / 'store'}", rank=0, world_size=1)
    t = torch.ones(1 << 20, device=dev)
    out = torch.empty(1 << 20, device=dev)
    n = 0
    for _ in range(3):
        dist.all_reduce(t)
        dist.all_gather_into_tensor(out, t)
        with dist._coalescing_manager(async_ops=False):
            dist.all_reduce(t)
            dist.all_reduce(out)
        n += 4
    note = "batch_isend_irecv to self: "
    try:
        r = torch.empty_like(t)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 0), dist.P2POp(dist.irecv, r, 0)]):
            w.wait()
        note += "ran (no proxy for a send to self: unfinished, untimed)"
    except Exception as e:            # some torch versions refuse a peer equal to the own rank
        note += f"refused by torch ({type(e).__name__})"
    torch.cuda.synchronize()
    return n, note


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
    vs = ".".join(map(str, ver))
    ngpu = torch.cuda.device_count()
    print(f"gpu-check: {torch.cuda.get_device_name(0)} x{ngpu}, torch {torch.__version__}, NCCL {vs}")
    if ver < NCCL_MIN:
        cannot(f"NCCL {vs} loads no profiler of ours: it probes v1-v3, the plugin exports v4-v6, the "
               "versions with device stamps (NCCL 2.27 and later)")
    if ngpu < 2 and ver < NCCL_SAME_GPU:
        cannot(f"one GPU and NCCL {vs}: a 2-rank communicator needs two GPUs, or NCCL 2.30+ "
               "(NCCL_MULTI_RANK_GPU_ENABLE; e.g. LD_PRELOAD=<nvidia-nccl 2.30+>/libnccl.so.2); "
               "a 1-rank one reaches no profiler")
    devs = [0, 1] if ngpu >= 2 else [0, 0]
    torch.cuda.set_device(0)
    host_colls, torch_note = torch_collectives(dist, torch, torch.device("cuda:0"), work)

    lib = nccl_library()
    pgs = []                          # two "process groups": 2-rank communicators, a stream per rank
    for _ in range(2):
        comms = (ctypes.c_void_p * 2)()
        ok(lib, lib.ncclCommInitAll(comms, 2, (ctypes.c_int * 2)(*devs)), "ncclCommInitAll")
        pgs.append([(comms[r], torch.cuda.Stream(device=devs[r])) for r in range(2)])
    bufs = [[torch.ones(ELEMS, device=f"cuda:{d}") for _ in range(3)] for d in devs]
    half = ELEMS // 2
    P = ctypes.c_void_p

    def issue(kind: str, r: int, comm, s) -> int:
        """The rank's calls of a launch on its stream; returns how many operations."""
        a, b, c = (P(x.data_ptr()) for x in bufs[r])
        st = P(s.cuda_stream)
        if kind == "all-reduce":
            ok(lib, lib.ncclAllReduce(a, b, ELEMS, NCCL_FLOAT32, NCCL_SUM, comm, st), "ncclAllReduce")
            return 1
        if kind == "coalesced RS+AG":
            ok(lib, lib.ncclReduceScatter(a, b, half, NCCL_FLOAT32, NCCL_SUM, comm, st), "ncclReduceScatter")
            ok(lib, lib.ncclAllGather(b, c, half, NCCL_FLOAT32, comm, st), "ncclAllGather")
            return 2
        ok(lib, lib.ncclSend(a, ELEMS, NCCL_FLOAT32, 1 - r, comm, st), "ncclSend")
        ok(lib, lib.ncclRecv(b, ELEMS, NCCL_FLOAT32, 1 - r, comm, st), "ncclRecv")
        return 2

    kinds = [("all-reduce", 0), ("coalesced RS+AG", 0), ("send/recv", 0), ("send/recv, group 2", 1)]
    launches = []                     # (kind, pg, rank, ops, stream, t_issue_ns, [ev0, ev1, ev2])
    for _ in range(ROUNDS):
        for kind, pg in kinds:
            for d in set(devs):
                torch.cuda.synchronize(d)
            t_issue = time.monotonic_ns()           # CLOCK_MONOTONIC, as the plugin's host times
            evs = {}
            for r, (comm, s) in enumerate(pgs[pg]):
                evs[r] = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                with torch.cuda.stream(s):
                    evs[r][0].record(s)
                    torch.cuda._sleep(SLEEP_CYCLES)
                    evs[r][1].record(s)
            ok(lib, lib.ncclGroupStart(), "ncclGroupStart")   # both ranks from this one thread
            nops = {r: issue(kind.split(",")[0], r, comm, s) for r, (comm, s) in enumerate(pgs[pg])}
            ok(lib, lib.ncclGroupEnd(), "ncclGroupEnd")
            for r, (comm, s) in enumerate(pgs[pg]):
                evs[r][2].record(s)
                launches.append((kind, pg, r, nops[r], s.cuda_stream, t_issue, evs[r]))
    for d in set(devs):
        torch.cuda.synchronize(d)
    for pg in pgs:
        for comm, _ in pg:
            ok(lib, lib.ncclCommDestroy(comm), "ncclCommDestroy")   # finalize: every record written
    dist.destroy_process_group()

    sink = Path(os.environ["INGERO_PROFILER_FILE"])
    rows = [dict(w.split("=", 1) for w in line.split()[1:]) for line in sink.read_text().splitlines()
            if line.startswith("op ")] if sink.exists() else []
    if not rows:
        cannot("the plugin wrote no record: was it loaded? (NCCL_DEBUG=INFO says; NCCL_PROFILER_PLUGIN="
               f"{os.environ.get('NCCL_PROFILER_PLUGIN')})")
    return judge(rows, launches, host_colls, torch_note)


def judge(rows: list[dict], launches: list, host_colls: int, torch_note: str) -> int:
    """Matches each launch of each rank with its records (by communicator and rank, in
    group order) and checks them; prints the table; 1 on any mismatch."""
    api = sorted({r["api"] for r in rows})
    timed = [r for r in rows if r["dev_start_raw"] != "0"]
    # the communicator of each (group, rank): v5+ by the stream its calls named; v4 (no
    # stream) by the order communicators first launched (ours last, group 1 before 2)
    first: dict = {}
    for r in sorted(timed, key=lambda r: int(r["host_start"])):
        first.setdefault(r["comm"], len(first))
    key = {}
    bad: list[str] = []
    for pg, rank in {(x[1], x[2]) for x in launches}:
        if api != ["4"]:
            want = {f"0x{x[4]:x}" for x in launches if (x[1], x[2]) == (pg, rank)}
            comms = {r["comm"] for r in timed if r["stream"] in want}
        else:
            comms = {h for h, i in first.items() if i == len(first) - 2 + pg}
        if len(comms) != 1:
            bad.append(f"group {pg + 1} rank {rank}: its launches are on {len(comms)} communicators, not 1")
        key[(pg, rank)] = (min(comms) if comms else None, str(rank))
    groups: dict = {}
    for r in timed:
        groups.setdefault((r["comm"], r["rank"]), {}).setdefault(int(r["group"]), []).append(r)
    cursor = {k: iter(sorted(groups.get(v, {}).items())) for k, v in key.items()}
    stats = {k: {"n": 0, "group": 0, "stream": 0, "span": [], "clock": [], "bad": []}
             for k in dict.fromkeys(x[0] for x in launches)}
    for kind, pg, rank, nops, stream, t_issue, evs in launches:
        st = stats[kind]
        st["n"] += 1
        _, ops = next(cursor[(pg, rank)], (None, []))
        if len(ops) != nops:          # a launch's operations: one Group event, one group number
            st["bad"].append(f"rank {rank}: a launch of {nops} operations has {len(ops)} records in its group")
            continue
        st["group"] += 1
        if api == ["4"] or all(o["stream"] == f"0x{stream:x}" for o in ops):
            st["stream"] += 1
        else:
            st["bad"].append(f"stream {ops[0]['stream']} reported, 0x{stream:x} used")
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
    colls = sum(1 for r in rows if r["kind"] == "coll")
    print(f"\nprofiler API v{', v'.join(api)}; {len(rows)} records, {len(timed)} with device times; torch: "
          f"{host_colls} one-rank collectives (local copies: untimed); {torch_note}; {colls} collective records")
    print(f"{'launch':<20}{'n':>4}{'group':>7}{'stream':>8}{'span-ev us (med/max)':>24}"
          f"{'clock us (med/max)':>22}  result")
    for kind, st in stats.items():
        span = f"{statistics.median(st['span']):+.1f}/{max(st['span'], key=abs):+.1f}" if st["span"] else "-"
        clock = f"{statistics.median(st['clock']):+.1f}/{max(st['clock'], key=abs):+.1f}" if st["clock"] else "-"
        res = "ok" if not st["bad"] else f"MISMATCH: {st['bad'][0]} ({len(st['bad'])} in all)"
        print(f"{kind:<20}{st['n']:>4}{st['group']:>7}{st['stream']:>8}{span:>24}{clock:>22}  {res}")
        bad += st["bad"]
    for b in bad[:5]:
        print(f"gpu-check: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
