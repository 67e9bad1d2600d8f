"""What reading the NCCL calls in flight costs the tracer (agent/ingero_agent/inflight.py).

    python -m bench.inflight_cost [--threads 64] [--rounds 200]

The probes add nothing per call for it: a call's frame is already in its thread's slot
between entry and return (bpf/nccl.c). The tracer reads the slots of its NCCL
processes' threads once per roll (2 s) and at stop. Here a process has `--threads`
threads blocked inside a probed ncclAllReduce (bench/csrc/nccl_block.c); one snapshot
reads every thread's /proc state and slot. Reported per slot storage (task-local storage
looked up with a pidfd of each thread; the hash fallback by pid_tgid): the median time
of a snapshot, per thread, and how many open calls it saw (must be all). And "stack":
the probes attach after the threads are inside the call (a job hung before the trace
began), so no slot holds it and each snapshot reads the calls from the threads' stacks
(ingero_agent.stackscan). Needs root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import compile_c, need_root


def _one(storage: str, loop: Path, lib: Path, threads: int, rounds: int) -> dict:
    from ingero_agent.elfsyms import nccl_symbols
    from ingero_agent.inflight import FrameReader, snapshot
    from ingero_agent.probes import ProbeConfig, Probes
    from ingero_agent.decode import op_name
    from ingero_agent.stackscan import StackScanner

    late = storage == "stack"
    p = Probes(ProbeConfig(families=("nccl",), self_tgid=os.getpid(), frame_storage="auto" if late else storage))
    proc = subprocess.Popen([str(loop), str(lib), str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "loaded"
        st, syms = lib.stat(), nccl_symbols(lib)

        def attach():
            p.attach_library(lib, (st.st_dev, st.st_ino), syms)
            p.set_targets(set(), {proc.pid}, set())
        if not late:
            attach()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ready"
        if late:
            attach()
        reader = FrameReader(p.bpf, "-DINGERO_TASK_STORAGE=1" in p.cflags)
        scanner = StackScanner()

        def stacks(pid, tids):
            return {t: op_name(f) for t, f in scanner.calls(pid, tids, lib, (st.st_dev, st.st_ino), syms).items()}
        times, seen = [], 0
        for _ in range(rounds):
            t0 = time.perf_counter()
            rows = snapshot(reader, Path("/proc"), [proc.pid], 0, 0, lambda pid: 0, stacks=stacks if late else None)
            times.append(time.perf_counter() - t0)
            seen = sum(r["op"] == "ALL_REDUCE" for r in rows)
        med = statistics.median(times)
        return {"storage": storage, "threads": len(rows), "open_calls_seen": seen,
                "snapshot_ms": round(med * 1e3, 3), "per_thread_us": round(med * 1e6 / len(rows), 1)}
    finally:
        proc.kill()
        proc.wait()
        p.close()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=64, help="threads inside a call; default 64")
    ap.add_argument("--rounds", type=int, default=200, help="snapshots timed per storage; default 200")
    a = ap.parse_args(argv)
    need_root("bench.inflight_cost")
    out = []
    with tempfile.TemporaryDirectory() as d:
        lib = compile_c(Path(d) / "libnccl_block.so", ["nccl_block.c"], shared=True)
        loop = compile_c(Path(d) / "inflight_threads", ["inflight_threads.c"], libs=("-ldl", "-lpthread"))
        for storage in ("task", "hash", "stack"):
            r = _one(storage, loop, lib, a.threads, a.rounds)
            print(f"{r['storage']:>4}: {r['open_calls_seen']}/{a.threads} open calls seen over {r['threads']} "
                  f"threads; a snapshot {r['snapshot_ms']} ms, {r['per_thread_us']} us per thread", flush=True)
            out.append(r)
    return out


if __name__ == "__main__":
    main()
