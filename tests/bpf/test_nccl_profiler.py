"""Ingero's NCCL profiler plugin under real eBPF tracing.

fixtures/profiler_harness.c drives the plugin (built by `ingero profiler
build`'s function) through NCCL's profiler ABI as NCCL does, for each API
version the plugin offers: init with that version's signature, coll/p2p
events from the user thread, kernel-channel events with GPU timestamps from a
"proxy" thread, finalize. Its GPU clock runs 500 ppm slow from an offset of
decades; the harness prints, per op, the host interval around NCCL's start
call and the true host times of the kernel's start and stop. Every row of
nccl_profiler_events must carry them: NCCL's seq and communicator, the raw
GPU stamps exactly, and the device times converted to the host clock within
TOLERANCE_NS (half a microsecond once the drift is fitted, after ~20 ms;
without the drift fit 25 us and more; without the device stamps none).
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from ingero.cbuild import INCLUDE_DIR
from tests.bpf.conftest import FIXTURES, spawn

HASH = 0x1234ABCD5678EF00
DRIFT_PPM = -500         # a slow GPU clock: the lowest (host - GPU) pair of a window is its oldest
QUEUE_NS = 300_000          # the harness's stream delay before each kernel
TOLERANCE_NS = 12_000     # 500 ppm over the first buckets (1/16 + 1/8 window: 19 ms) with no drift term yet
ENV = dict(os.environ, INGERO_PROFILER_CLOCK_WINDOW_MS="100")
COLS = ("op, seq, rank, nranks, nnodes, comm_hash, comm_name, count, bytes, datatype, peer, algo, proto, "
        "nchannels, channels, unfinished, profiler_api, ts_mono_ns, timestamp_ns - ts_mono_ns, "
        "device_start_ns, device_end_ns, device_start_raw, device_end_raw, device_duration_ns, "
        "host_duration_ns, clock_samples, dropped, pid, tid, group_id, stream")
OPS = {"AllReduce": ("ALL_REDUCE", 2, "float32", 4, None, "RING", "SIMPLE"),
       "Send": ("SEND", 1, "float16", 2, 2, None, None),
       "Recv": ("RECV", 1, "float16", 2, 0, None, None),
       "Broadcast": ("BROADCAST", 0, "int8", 1, 3, "RING", "SIMPLE"),
       "AllGather": ("ALL_GATHER", 2, "bfloat16", 2, None, "RING", "SIMPLE")}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    from ingero_agent.profiler_build import build_profiler
    d = tmp_path_factory.mktemp("profiler")
    lib = build_profiler(d / "lib", cache_dir=d / "cache")
    harness = d / "profiler_harness"
    subprocess.run(["gcc", "-O1", "-Wall", f"-I{INCLUDE_DIR}", "-o",
                    str(harness), str(FIXTURES / "profiler_harness.c"), "-ldl", "-lpthread"], check=True)
    return {"lib": lib, "harness": harness}


def start_harness(plugin, tmp_path, api: int, ops: int, cgroup=None, nccl=None):
    go = tmp_path / f"go-{uuid.uuid4().hex}"
    argv = [str(plugin["harness"]), str(plugin["lib"]), str(api), str(go), str(ops), str(DRIFT_PPM)]
    if nccl:
        argv.append(str(nccl))
    h = spawn(argv, cgroup, env=ENV)
    # Coll | P2p | KernelCh, and ProxyOp | ProxyStep | NetPlugin for the proxy summaries
    assert h.stdout.readline().split() == ["mask", str(2 | 4 | 64 | 8 | 16 | 128)]
    assert h.stdout.readline().strip() == "ready"
    return h, go


def finish(h) -> list[list[str]]:
    out, err = h.communicate(timeout=60)
    assert h.returncode == 0, err
    assert out.splitlines()[-1] == "done"
    return [line.split()[1:] for line in out.splitlines() if line.startswith("expect ")]


@pytest.mark.parametrize("api", [4, 5, 6])
def test_every_operation_is_recorded_with_its_device_times_on_the_host_clock(plugin, trace, tmp_path, api):
    ops = 60
    h, go = start_harness(plugin, tmp_path, api, ops)
    t = trace("--pid", str(h.pid), "--probes", "nccl", "--profiler-lib", str(plugin["lib"]))
    t.wait_for_line("attached the NCCL profiler probe")
    go.touch()
    want = finish(h)
    t.stop()
    rows = t.query(f"SELECT {COLS} FROM nccl_profiler_events ORDER BY ts_mono_ns")
    assert len(rows) == len(want) == 4 * ops + 1
    tids = set()
    groups = {}
    for (func, seq, t0, t1, ds, de, gs, ge, group, stream), row in zip(want, rows):
        (op, rseq, rank, nranks, nnodes, comm_hash, comm_name, count, nbytes, dtype, peer, algo, proto,
         nch, channels, unfinished, papi, mono, offset, dev0, dev1, raw0, raw1, dur, host_dur, samples,
         dropped, pid, tid, group_id, rstream) = row
        assert group_id == int(group) and rstream == (None if api == 4 else int(stream))
        groups.setdefault(group_id, []).append(op)
        name, want_nch, want_dt, size, want_peer, want_algo, want_proto = OPS[func]
        assert (op, rseq, rank, nranks, nnodes, comm_hash, comm_name) == (name, int(seq), 1, 4, 2, HASH, "dp-0")
        assert (dtype, nbytes, peer, algo, proto, nch, papi, pid) == \
            (want_dt, count * size, want_peer, want_algo, want_proto, want_nch, api, h.pid)
        assert dropped == 0 and host_dur > 0
        assert int(t0) <= mono <= int(t1)                         # NCCL's start call, on the host
        if func == "Broadcast":                                   # no channels: no kernel events
            assert (dev0, dev1, raw0, raw1, channels, unfinished) == (None, None, None, None, 0, False)
            continue
        assert raw0 == int(gs)                                    # the GPU's own stamps, untouched
        assert abs(dev0 - offset - int(ds)) <= TOLERANCE_NS       # converted to the host clock
        assert dev0 - offset >= mono + QUEUE_NS                   # the device ran it later than the call
        assert samples > 0
        if func == "AllGather":                                   # its kernel never stopped: recorded
            assert (unfinished, channels, dev1, raw1, dur, tid) == (True, 0, None, None, None, h.pid)
            continue                                              # by finalize, on the main thread
        tids.add(tid)
        assert (unfinished, channels) == (False, want_nch)
        assert raw1 == int(ge) and dur == int(ge) - int(gs)
        assert abs(dev1 - offset - int(de)) <= TOLERANCE_NS
    assert tids and h.pid not in tids                             # finished on the "proxy" thread
    assert sorted(groups.values()) == sorted([["ALL_REDUCE"], ["SEND", "RECV"], ["BROADCAST"]] * ops
                                             + [["ALL_GATHER"]])   # the grouped send and recv share one
    assert t.query("SELECT lost_nccl_profiler, events_nccl_profiler FROM nodes") == [(0, len(rows))]


def test_p2p_seq_counts_each_peer_and_direction_apart_so_sends_pair_with_receives(plugin, trace, tmp_path):
    h, go = start_harness(plugin, tmp_path, 6, 5)
    t = trace("--pid", str(h.pid), "--probes", "nccl", "--profiler-lib", str(plugin["lib"]))
    go.touch()
    finish(h)
    t.stop()
    got = t.query("SELECT op, peer, list(seq ORDER BY ts_mono_ns) FROM nccl_profiler_events "
                  "WHERE op IN ('SEND', 'RECV') GROUP BY ALL ORDER BY op")
    assert got == [("RECV", 0, [0, 1, 2, 3, 4]), ("SEND", 2, [0, 1, 2, 3, 4])]


def test_only_a_harness_in_the_traced_cgroup_is_recorded_and_its_plugin_is_found_by_scanning(
        plugin, fake_nccl, trace, make_cgroup, tmp_path):
    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "nccl")              # no --profiler-lib
    inside, go = start_harness(plugin, tmp_path, 5, 3, cgroup=cg, nccl=fake_nccl["lib"])
    t.wait_for_line("attached the NCCL profiler probe")
    outside, go2 = start_harness(plugin, tmp_path, 5, 3, nccl=fake_nccl["lib"])   # root cgroup
    go.touch()
    go2.touch()
    finish(inside)
    finish(outside)
    t.stop()
    assert t.query("SELECT pid, count(*) FROM nccl_profiler_events GROUP BY pid") == [(inside.pid, 4 * 3 + 1)]


def test_a_file_that_is_not_the_plugin_is_refused_in_one_line(fake_nccl, tmp_path):
    import sys
    proc = subprocess.run([sys.executable, "-m", "ingero", "trace", "--pid", str(os.getpid()), "--profiler-lib",
                           str(fake_nccl["lib"]), "--out", str(tmp_path / "t.duckdb")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"ingero: --profiler-lib {fake_nccl['lib']} is not Ingero's NCCL profiler plugin; build it with "
        "`ingero profiler build`"]
