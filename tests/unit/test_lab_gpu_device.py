"""The lab's GPU-like device, non-blocking communicators and profiler plugin calls.

Each rank is a process of its own (tests/unit/lab_rank.py: the device mode is
read once per process) talking to the others over loopback; this process
serves the rendezvous. The profiler tests load fixtures/record_profiler.c, a
plugin that writes down every call NCCL's profiler ABI makes to it.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from ingero.cbuild import INCLUDE_DIR
from ingero.lab.build import build_lab_binaries
from tests.unit.lab_rank import UniqueId

HERE = Path(__file__).parent
RANK = HERE / "lab_rank.py"
COLL, P2P, KCH, GROUP, GROUP_API, COLL_API, P2P_API = 2, 4, 64, 1, 256, 512, 1024
KCH_STOP = 22


@pytest.fixture(scope="module")
def bins(tmp_path_factory):
    return build_lab_binaries(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def recorders(tmp_path_factory) -> dict[int, Path]:
    """The recording plugin built three times: exporting up to v4, v5 and v6."""
    d = tmp_path_factory.mktemp("record")
    out = {}
    for api in (4, 5, 6):
        out[api] = d / f"librecord{api}.so"
        subprocess.run(["gcc", "-O1", "-Wall", "-shared", "-fPIC", f"-I{INCLUDE_DIR}", f"-DAPI_MAX={api}",
                        "-o", str(out[api]), str(HERE / "fixtures" / "record_profiler.c")], check=True)
    return out


def run_ranks(bins, scenario: str, n: int = 2, env: dict | None = None, env_of=None) -> list[dict]:
    lib = ctypes.CDLL(str(bins.libnccl))
    uid = UniqueId()
    assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0   # this process serves the rendezvous
    base = {k: v for k, v in os.environ.items() if not k.startswith(("INGERO_LAB_", "NCCL_", "MASTER_"))}
    base.update({"NCCL_CPU_TIMEOUT_S": "20", "PYTHONPATH": str(HERE.parents[1])}, **(env or {}))
    procs = [subprocess.Popen([sys.executable, str(RANK), scenario, str(bins.libnccl), str(r), str(n),
                               bytes(uid).hex()], env=dict(base, **(env_of(r) if env_of else {})),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e for _, e in outs]
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def test_on_the_gpu_like_device_calls_return_at_enqueue_and_the_data_is_there_after_the_sync(bins):
    for r in run_ranks(bins, "async", env={"INGERO_LAB_DEVICE": "gpu"}):
        assert r["async"] == 1
        assert r["launch_ms"] < 50 and r["call_ms"] < 50, r    # the 300 ms kernel is queued, not run
        assert r["before"] == 0.0 and r["after"] == 3.0, r     # data moved only on the device
        assert r["total_ms"] >= 295, r                          # the sync waited for kernel and all-reduce


def test_on_the_cpu_device_a_call_returns_once_its_work_ran(bins):
    for r in run_ranks(bins, "async", env={"INGERO_LAB_DEVICE": "cpu"}):
        assert r["async"] == 0
        assert r["launch_ms"] >= 295, r
        assert r["before"] == 3.0 == r["after"], r


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_a_non_blocking_communicator_is_in_progress_until_its_init_split_and_calls_are_done(bins, device):
    ranks = run_ranks(bins, "nonblocking", env={"INGERO_LAB_DEVICE": device})
    for rank, r in enumerate(ranks):
        # init: ncclInProgress with the handle already written, as NCCL does
        assert (r["init_rc"], r["init_handle"], r["init_settled"]) == (7, True, 0), r
        assert (r["coll_rc"], r["coll_settled"], r["coll_value"]) == (7, 0, 3.0), r
        # split: ncclInProgress, and the child's handle once it completed (rank 1 came last, so
        # its split may complete before it looks: only rank 0's early look is certain, below)
        assert (r["split_rc"], r["split_settled"], r["child"]) == (7, 0, True), r
        assert r["child_state"] == 0 and r["child_rank"] == 1 - rank            # key n - rank reverses
        assert (r["child_coll_rc"], r["child_coll_settled"], r["child_value"]) == (7, 0, 3.0), r
        assert (r["group_rc"], r["group_settled"], r["p2p_value"]) == (7, 0, float(1 - rank)), r
    # rank 0 came first: it saw its init and split still under way while rank 1 slept (no child
    # handle yet), and a call on the communicator before the init finished was refused (NCCL:
    # ncclInvalidArgument)
    r0 = ranks[0]
    assert (r0["init_state"], r0["early_rc"]) == (7, 4), r0
    assert (r0["split_child"], r0["split_state"], r0["split_child_later"]) == (False, 7, False), r0


def test_a_bad_device_setting_fails_the_worker_in_one_line(bins):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", INGERO_LAB_DEVICE="tpu")
    p = subprocess.run([str(bins.worker)], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["ingero-lab-worker: rank 0: INGERO_LAB_DEVICE=tpu: use cpu or gpu"]


# ---- the profiler plugin ----------------------------------------------------------

def record(bins, recorders, tmp_path, api: int = 6, device: str = "gpu", mask: int | None = None) -> list[list]:
    """Runs the profile scenario on 2 ranks with the recording plugin; per rank its parsed calls."""
    env = {"INGERO_LAB_DEVICE": device, "NCCL_PROFILER_PLUGIN": str(recorders[api])}
    if mask is not None:
        env["RECORD_PROFILER_MASK"] = str(mask)
    res = run_ranks(bins, "profile", env=env,
                    env_of=lambda r: {"RECORD_PROFILER_OUT": str(tmp_path / f"rank{r}.rec")})
    assert all(r["verified"] for r in res)
    out = []
    for r in range(2):
        path = tmp_path / f"rank{r}.rec"
        out.append([line.split() for line in path.read_text().splitlines()] if path.exists() else [])
    return out


def events(lines: list[list]) -> dict[int, dict]:
    """id -> {type, parent, ctx, fields, tid, ns, states: [(state, ptimer, ns)], stop: (tid, ns)}."""
    ev: dict[int, dict] = {}
    for w in lines:
        if w[0] == "start":
            ctx, i, typ, parent = map(int, w[1:5])
            ev[i] = {"ctx": ctx, "type": typ, "parent": parent, "fields": w[5:-2], "tid": int(w[-2]),
                     "ns": int(w[-1]), "states": [], "stop": None}
        elif w[0] == "state":
            ev[int(w[1])]["states"].append((int(w[2]), int(w[3]), int(w[5])))
        elif w[0] == "stop" and int(w[1]):
            ev[int(w[1])]["stop"] = (int(w[2]), int(w[3]))
    return ev


@pytest.mark.parametrize("api", [4, 5, 6])
def test_the_newest_plugin_version_is_loaded_and_every_communicator_is_initialised_and_finalised(
        bins, recorders, tmp_path, api):
    per_rank = record(bins, recorders, tmp_path, api=api)
    inits = [[w[1:7] for w in lines if w[0] == "init"] for lines in per_rank]
    for rank, mine in enumerate(inits):
        assert [(a, nn, nr, rk) for a, _, _, nn, nr, rk in mine] == [(str(api), "1", "2", str(rank))] * 2
    # NCCL's commHash: the same on both ranks, one per communicator (world, split)
    hashes = [[x[2] for x in mine] for mine in inits]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) == 2
    for lines in per_rank:
        ctxs = {w[2] for w in lines if w[0] == "init"}
        assert {w[1] for w in lines if w[0] == "finalize"} == ctxs


@pytest.mark.parametrize("api", [4, 6])
def test_each_launch_starts_a_group_and_one_task_per_operation_named_and_numbered_as_nccl_does(
        bins, recorders, tmp_path, api):
    per_rank = record(bins, recorders, tmp_path, api=api)
    for rank, lines in enumerate(per_rank):
        ev = events(lines)
        tasks = [e for e in ev.values() if e["type"] in (COLL, P2P)]
        colls = [tuple(e["fields"][:6]) for e in tasks if e["type"] == COLL]
        # seq per communicator and function; AllGather and Broadcast in bytes (ncclInt8), as NCCL
        assert colls == [("0", "AllReduce", "ncclFloat32", "100000", "0", "2"),
                         ("1", "AllReduce", "ncclFloat32", "10", "0", "2"),
                         ("0", "AllGather", "ncclInt8", "20", "0", "2"),
                         ("0", "Broadcast", "ncclInt8", "12", "0", "2"),
                         ("0", "ReduceScatter", "ncclFloat32", "4", "0", "2"),
                         ("1", "AllGather", "ncclInt8", "16", "0", "2")]
        p2p = sorted(tuple(e["fields"][:5]) for e in tasks if e["type"] == P2P)
        assert p2p == [("Recv", "ncclFloat32", "64", str(1 - rank), "1"), ("Send", "ncclFloat32", "64", str(1 - rank), "1")]
        groups = {i for i, e in ev.items() if e["type"] == GROUP}
        apis = {i: e for i, e in ev.items() if e["type"] in (COLL_API, P2P_API, GROUP_API)}
        caller = tasks[0]["tid"]
        for t in tasks:
            group = t["parent"] if api == 4 else int(t["fields"][-1])
            assert group in groups and t["stop"][0] == t["tid"] == caller   # host: launched and enqueued
            if api == 4:
                assert not apis                                              # v4 never sees API events
            else:
                assert apis[t["parent"]]["type"] == (COLL_API if t["type"] == COLL else P2P_API)
        if api == 6:   # one GroupApi per group: 4 ungrouped calls, the Send/Recv and the coalesced group
            assert sum(e["type"] == GROUP_API for e in apis.values()) == 6


def test_kernel_channels_come_from_the_device_after_the_work_ran_with_gpu_timer_stamps(bins, recorders, tmp_path):
    for lines in record(bins, recorders, tmp_path, device="gpu"):
        ev = events(lines)
        tasks = {i: e for i, e in ev.items() if e["type"] in (COLL, P2P)}
        kch = defaultdict(list)
        for e in ev.values():
            if e["type"] == KCH:
                kch[e["parent"]].append(e)
        assert set(kch) == set(tasks)
        caller = next(iter(tasks.values()))["tid"]
        pairs = []
        for i, t in tasks.items():
            chans = kch[i]
            assert sorted(int(c["fields"][0]) for c in chans) == list(range(2 if t["type"] == COLL else 1))
            for c in chans:
                assert c["tid"] != caller and c["stop"][0] == c["tid"]       # the device thread
                (state, stop_g, stop_ns), = c["states"]
                start_g = int(c["fields"][1])
                assert state == KCH_STOP and start_g <= stop_g
                assert c["ns"] >= t["ns"] and stop_ns <= c["stop"][1]        # after its launch; stop last
                pairs += [(c["ns"], start_g), (stop_ns, stop_g)]
        # the GPU timer is not the host clock: an offset of decades, found as the lowest host - GPU
        offset = min(h - g for h, g in pairs)
        assert abs(offset) > 10**15
        ar = sorted((e for e in tasks.values() if e["fields"][1] == "AllReduce"), key=lambda e: e["ns"])
        dev = {id(t): [int(c["fields"][1]) + offset for c in kch[i]] for i, t in tasks.items()}
        ends = {id(t): [c["states"][0][1] + offset for c in kch[i]] for i, t in tasks.items()}
        # the first all-reduce ran after the 200 ms kernel queued before it, and the second after it
        assert min(dev[id(ar[0])]) - ar[0]["ns"] >= 190e6
        assert min(dev[id(ar[1])]) >= max(ends[id(ar[0])])


@pytest.mark.parametrize("api", [4, 6])
def test_a_groups_operations_run_as_one_kernel_sharing_its_group_event_and_device_stamps(
        bins, recorders, tmp_path, api):
    for lines in record(bins, recorders, tmp_path, api=api):
        ev = events(lines)
        by_group = defaultdict(list)      # group event -> [(task, function)]
        for i, e in ev.items():
            if e["type"] in (COLL, P2P):
                group = e["parent"] if api == 4 else int(e["fields"][-1])
                by_group[group].append((i, e["fields"][0 if e["type"] == P2P else 1]))
        stamps = {}
        for i, e in ev.items():
            if e["type"] == KCH:
                stamps.setdefault(e["parent"], set()).add((int(e["fields"][1]), e["states"][0][1]))
        launches = sorted(sorted(f for _, f in ops) for ops in by_group.values())
        assert launches == sorted([["AllReduce"], ["AllReduce"], ["AllGather"], ["Broadcast"], ["Recv", "Send"],
                                   ["AllGather", "ReduceScatter"]])
        for ops in by_group.values():     # every channel of every operation of a launch: one interval
            assert len(set().union(*(stamps[i] for i, _ in ops))) == 1


def test_on_the_cpu_device_kernel_channels_come_from_the_calling_thread(bins, recorders, tmp_path):
    for lines in record(bins, recorders, tmp_path, device="cpu"):
        ev = events(lines)
        tids = {e["tid"] for e in ev.values() if e["type"] in (COLL, KCH)}
        assert len(tids) == 1


def test_only_the_event_types_the_plugin_asked_for_below_its_mask_are_started(bins, recorders, tmp_path):
    for lines in record(bins, recorders, tmp_path, mask=COLL | P2P):
        types = {e["type"] for e in events(lines).values()}
        assert KCH not in types and {COLL, P2P} <= types


def test_no_plugin_is_loaded_with_nccl_profiler_plugin_none(bins, tmp_path):
    res = run_ranks(bins, "profile", env={"INGERO_LAB_DEVICE": "gpu", "NCCL_PROFILER_PLUGIN": "none",
                                          "RECORD_PROFILER_OUT": str(tmp_path / "x.rec")})
    assert all(r["verified"] for r in res) and not (tmp_path / "x.rec").exists()


def sink_lines(path: Path, kind: str = "op") -> list[dict]:
    """The plugin's file sink: one dict per `op key=value ...` line (`kind="proxy"`: per proxy
    summary line)."""
    return [dict(w.split("=", 1) for w in line.split()[1:]) for line in path.read_text().splitlines()
            if line.startswith(kind + " ")]


def test_ingeros_plugin_writes_each_operation_with_its_launch_and_stream_to_its_file_sink(bins, tmp_path):
    """The real plugin (as scripts/gpu-check.sh runs it, with a file sink) in the lab's NCCL:
    the operations of a launch share its group number and device interval; each other
    operation is a launch of its own; profiler API v6 carries the call's stream."""
    from ingero_agent.profiler_build import build_profiler

    lib = build_profiler(tmp_path / "lib", cache_dir=tmp_path / "cache")
    res = run_ranks(bins, "profile", env={"INGERO_LAB_DEVICE": "gpu", "NCCL_PROFILER_PLUGIN": str(lib)},
                    env_of=lambda r: {"INGERO_PROFILER_FILE": str(tmp_path / f"rank{r}.ops")})
    assert all(r["verified"] for r in res)
    for r in range(2):
        ops = sink_lines(tmp_path / f"rank{r}.ops")
        assert {o["api"] for o in ops} == {"6"} and all(o["stream"] == "0x0" for o in ops)
        launches = defaultdict(list)
        for o in ops:
            assert o["flags"] == "2" and o["channels"] == o["nchannels"] and o["dev_start"] <= o["dev_stop"]
            launches[(o["comm"], o["group"])].append(o)
        assert sorted(sorted(o["func"] for o in g) for g in launches.values()) == sorted(
            [["AllReduce"], ["AllReduce"], ["AllGather"], ["Broadcast"], ["Recv", "Send"],
             ["AllGather", "ReduceScatter"]])
        for g in launches.values():
            assert len({(o["dev_start_raw"], o["dev_stop_raw"]) for o in g}) == 1
        # the transfers' proxy summaries: each collective's and p2p call's, over the loopback socket
        proxy = sink_lines(tmp_path / f"rank{r}.ops", "proxy")
        assert {p["func"] for p in proxy} >= {"AllReduce", "AllGather", "Send", "Recv"}, proxy
        assert all(p["net"] == "2" and p["nic"] == "lo" and int(p["bytes"]) > 0 for p in proxy), proxy


def test_each_communicator_s_stream_runs_beside_the_others_and_the_plugin_names_it(bins, tmp_path):
    """A stream per communicator, as PyTorch's process groups have: an all-reduce on C's stream
    is done while a 300 ms kernel still holds A's (A's all-reduce not yet run); made to wait for
    A's stream, C's next one ends after it. The plugin records each operation's stream."""
    from ingero_agent.profiler_build import build_profiler

    lib = build_profiler(tmp_path / "lib", cache_dir=tmp_path / "cache")
    res = run_ranks(bins, "streams", env={"INGERO_LAB_DEVICE": "gpu", "NCCL_PROFILER_PLUGIN": str(lib)},
                    env_of=lambda r: {"INGERO_PROFILER_FILE": str(tmp_path / f"rank{r}.ops")})
    for r, out in enumerate(res):
        assert out["verified"] and out["a_when_c_done"] == r + 1, out
        assert out["c_ms"] < 200 and out["waited_ms"] >= 290, out
        ops = sink_lines(tmp_path / f"rank{r}.ops")
        by_comm = defaultdict(set)
        for o in ops:
            by_comm[o["comm"]].add(o["stream"])
        assert sorted(len(v) for v in by_comm.values()) == [1, 1] and len(set().union(*by_comm.values())) == 2
        assert "0x0" not in set().union(*by_comm.values())


def test_a_file_sink_that_cannot_be_opened_leaves_the_job_running_without_the_plugin(bins, tmp_path):
    from ingero_agent.profiler_build import build_profiler

    lib = build_profiler(tmp_path / "lib", cache_dir=tmp_path / "cache")
    res = run_ranks(bins, "profile", env={"INGERO_LAB_DEVICE": "gpu", "NCCL_PROFILER_PLUGIN": str(lib),
                                          "INGERO_PROFILER_FILE": str(tmp_path / "no" / "such" / "dir")})
    assert all(r["verified"] for r in res)
