"""Sustained ingest: the highest NCCL-event rate the agent's drain path keeps with zero loss.

    python -m bench.ingest [--rates 250000,500000,1000000,1500000,2000000] [--seconds 5]

A BPF program on raw_syscalls:sys_enter (bench/csrc/ingest_producer.c) turns
each getppid() of a paced pump process into a batch of records with the
agent's NCCL record layout, in a ring buffer like the agent's. This process
then drains it exactly as the tracer does: the mmap bulk reader
(`ingero_agent.ringbuf`), bulk decode (`ingero_agent.decode.nccl_columns`)
and the Parquet segment writer (`ingero.store.SegmentWriter`, rolled every
2 s). For each rate: events kept, lost, this process's CPU seconds per
event, and bytes per event on disk. Needs root.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import CSRC, compile_c, need_root

BATCH = 32
RING_PAGES = 16384  # 64 MiB
POLL_S = 0.05       # a fixed drain period (TraceOptions.poll_s, the tracer's fallback); the
#                     tracer's own epoll-driven loop is exercised by tests/bpf/test_ring_wakeups.py


def run_rate(rate: int, seconds: float, pump: Path, out: Path) -> dict:
    from bcc import BPF

    from ingero_agent.decode import Registry, nccl_columns
    from ingero_agent.probes import bpf_dir
    from ingero_agent.records import NCCL_EVENT
    from ingero_agent.ringbuf import open_ring
    from ingero.store import SegmentWriter

    calls_per_s = rate / BATCH
    p = subprocess.Popen([str(pump), str(calls_per_s), str(seconds)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    b = BPF(src_file=str(CSRC / "ingest_producer.c"),
            cflags=[f"-I{bpf_dir()}", f"-DPUMP_TGID={p.pid}", f"-DINGEST_BATCH={BATCH}",
                    f"-DINGERO_RINGBUF_PAGES={RING_PAGES}"])
    ring = open_ring(b, "nccl_events", RING_PAGES * 4096, NCCL_EVENT)
    writer = SegmentWriter(out, node="bench", session_id=f"r{rate}")
    reg = Registry()
    kept = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    p.stdin.write("go\n")
    p.stdin.flush()
    try:
        while True:  # the tracer's loop: drain, decode, append, roll, sleep one poll interval
            done = p.poll() is not None
            arr = ring.read()
            if len(arr):
                kept += len(arr)
                writer.append("nccl_events", nccl_columns(arr, 0, reg))
            writer.maybe_roll()
            if done:
                break
            time.sleep(POLL_S)
        arr = ring.read()
        if len(arr):
            kept += len(arr)
            writer.append("nccl_events", nccl_columns(arr, 0, reg))
        writer.close()
    finally:
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        lost = int(b["ingest_lost"][0].value)
        calls = int(p.stdout.readline() or 0)
        p.wait()
        ring.close()
        b.cleanup()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    size = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    return {"rate": rate, "produced": calls * BATCH, "kept": kept, "lost": lost,
            "achieved_per_s": kept / seconds, "cpu_s": cpu, "wall_s": wall,
            "cpu_us_per_event": 1e6 * cpu / max(kept, 1), "bytes_per_event": size / max(kept, 1)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="500000,1000000,2000000,3000000,4000000")
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args(argv)
    need_root("ingest")
    results = []
    with tempfile.TemporaryDirectory() as d:
        pump = compile_c(Path(d) / "syscall_pump", ["syscall_pump.c"])
        for rate in (int(x) for x in a.rates.split(",")):
            r = run_rate(rate, a.seconds, pump, Path(d) / f"seg-{rate}")
            results.append(r)
            print(f"ingest {rate:>9,}/s asked: kept {r['kept']:,} of {r['produced']:,} "
                  f"({r['achieved_per_s']:,.0f}/s), lost {r['lost']:,}, "
                  f"drain CPU {r['cpu_us_per_event']:.2f} us/event, "
                  f"{r['bytes_per_event']:.1f} B/event on disk")
    ok = [r["rate"] for r in results if r["lost"] == 0 and r["kept"] == r["produced"]]
    print(f"ingest: highest rate with zero lost events: {max(ok):,}/s" if ok else
          "ingest: every rate lost events")
    return results


if __name__ == "__main__":
    main()
