"""The lab's layout job (worker.c run_layout) under each pipeline schedule, on loopback.

Every rank checks every block it received (the sending stage, step and slot are in
the data; wrong data exits 4), so a run where all ranks exit 0 means the schedule's
sends and receives matched up, grouped or not, on the CPU and the GPU-like device.
The stop decision goes through the store, not through a collective: all ranks must
still run the same number of steps."""

from __future__ import annotations

import json
import subprocess

import pytest

from ingero.errors import IngeroError
from tests.unit.test_lab_build import bins, free_port, worker_env  # noqa: F401
from tests.unit.test_lab_gpu_device import COLL, KCH, P2P, events, recorders  # noqa: F401

STOP_MARGIN = 5   # worker.c: rank 0's decision at the end of step s makes s + 5 the last step


def run_layout(bins, layout: tuple[int, int, int], schedule: str, env_of=lambda r: {}, reported: str | None = None,
               **extra) -> list[dict]:
    t, p, d = layout
    n, port = t * p * d, free_port()
    env = dict(INGERO_LAB_LAYOUT=f"{t},{p},{d}", INGERO_LAB_SCHEDULE=schedule, INGERO_LAB_TIMEOUT_S="20",
               INGERO_LAB_STEPS="4", INGERO_LAB_COMPUTE_MS="4")
    env.update({k: str(v) for k, v in extra.items()})
    procs = [subprocess.Popen([str(bins.worker)], env=worker_env(r, n, port, **env, **env_of(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = [pr.communicate(timeout=60) for pr in procs]
    assert [pr.returncode for pr in procs] == [0] * n, [e for _, e in outs]
    stats = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert all(s["verified"] and s["schedule"] == (reported or schedule) for s in stats)
    return stats


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("layout,schedule,extra", [
    ((2, 2, 2), "1f1b", {}),
    ((2, 2, 2), "gpipe", {}),
    ((2, 2, 2), "interleaved", {}),                                   # P = 2: both neighbours one rank
    ((1, 4, 1), "1f1b", {"INGERO_LAB_MICROBATCHES": 2}),             # fewer microbatches than warm-up
    ((1, 4, 1), "interleaved", {}),                                   # M == P: all warm-up
    ((1, 4, 1), "interleaved", {"INGERO_LAB_MICROBATCHES": 8}),
    ((1, 3, 1), "interleaved", {"INGERO_LAB_MICROBATCHES": 6, "INGERO_LAB_VIRTUAL_STAGES": 3}),
    ((2, 1, 2), "1f1b", {}),                                          # no pipeline: tensor x data
], ids=lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else None)
def test_every_schedule_matches_its_sends_and_receives_and_runs_the_asked_steps(bins, device, layout, schedule,
                                                                                extra):
    stats = run_layout(bins, layout, schedule, INGERO_LAB_DEVICE=device, **extra)
    assert [s["steps"] for s in stats] == [4] * len(stats)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_grouped_exchanges_settle_on_non_blocking_communicators(bins, schedule, device):
    stats = run_layout(bins, (2, 2, 2), schedule, INGERO_LAB_NONBLOCKING=1, INGERO_LAB_DEVICE=device)
    assert [s["steps"] for s in stats] == [4] * 8


def test_rank_zero_stops_every_rank_through_the_store_a_margin_of_steps_later(bins, tmp_path):
    stop = tmp_path / "stop"
    stop.touch()   # rank 0 decides at the end of its first step
    stats = run_layout(bins, (2, 2, 2), "1f1b", INGERO_LAB_STEPS=0, INGERO_LAB_SECONDS=0,
                       INGERO_LAB_STOP_FILE=stop)
    assert [s["steps"] for s in stats] == [1 + STOP_MARGIN] * 8


def test_a_time_limit_ends_every_rank_at_the_same_step(bins):
    stats = run_layout(bins, (1, 2, 2), "1f1b", INGERO_LAB_STEPS=0, INGERO_LAB_SECONDS=1)
    steps = {s["steps"] for s in stats}
    assert len(steps) == 1 and steps.pop() > STOP_MARGIN


@pytest.mark.parametrize("env,why", [
    ({"INGERO_LAB_SCHEDULE": "zigzag"}, "INGERO_LAB_SCHEDULE must be 1f1b, gpipe or interleaved"),
    ({"INGERO_LAB_SCHEDULE": "interleaved", "INGERO_LAB_MICROBATCHES": "3"}, "a multiple of P"),
])
def test_a_bad_schedule_setting_fails_the_worker_in_one_line(bins, env, why):
    p = subprocess.run([str(bins.worker)], env=worker_env(0, 2, free_port(), INGERO_LAB_LAYOUT="1,2,1", **env),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and why in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("kw,why", [
    ({"schedule": "zigzag"}, "--schedule 'zigzag'"),
    ({"schedule": "interleaved", "microbatches": 3}, "--microbatches a multiple of pp"),
    ({"schedule": "interleaved", "layout": "tp=2,pp=1,dp=4"}, "needs pp > 1"),
])
def test_the_lab_refuses_a_schedule_the_layout_cannot_run(kw, why):
    from ingero.lab.runner import LabConfig, LabRun

    cfg = LabConfig(nodes=2, ranks_per_node=4, **{"layout": "tp=2,pp=2,dp=2", **kw})
    with pytest.raises(IngeroError, match=why.replace("(", r"\(").replace(")", r"\)")):
        LabRun(cfg, log=lambda _m: None)


@pytest.mark.parametrize("layout,replicas,device", [((2, 1, 2), 1, "cpu"), ((1, 1, 4), 2, "gpu")])
def test_an_fsdp_job_gathers_and_reduce_scatters_every_layer_and_checks_every_block(bins, layout, replicas,
                                                                                   device):
    stats = run_layout(bins, layout, "1f1b", INGERO_LAB_SHARDING="fsdp", INGERO_LAB_REPLICAS=replicas,
                       INGERO_LAB_LAYERS=3, INGERO_LAB_DEVICE=device, INGERO_LAB_NONBLOCKING=int(device == "gpu"),
                       reported="hsdp" if replicas > 1 else "fsdp")
    assert [s["steps"] for s in stats] == [4] * len(stats)


@pytest.mark.parametrize("kw,why", [
    ({"layout": "tp=2,pp=2,dp=2"}, "without a pipeline"),
    ({"layout": "tp=2,dp=4", "replicas": 3}, "--replicas dividing dp"),
    ({"layout": "tp=8"}, "dp >= 2"),
])
def test_the_lab_refuses_an_fsdp_job_its_layout_cannot_run(kw, why):
    from ingero.lab.runner import LabConfig, LabRun

    with pytest.raises(IngeroError, match=why):
        LabRun(LabConfig(nodes=2, ranks_per_node=4, sharding="fsdp", **kw), log=lambda _m: None)


def test_the_profiler_sees_an_fsdp_layers_collectives_coalesced_in_one_launch_each(bins, recorders, tmp_path):
    """HSDP, dp=4 as 2 replicas of 2-rank shard groups, 3 layers, on the GPU-like device: per
    step and rank 6 launches of two all-gathers (each layer forward and backward) and 3 of two
    reduce-scatters, all on the shard group, each launch's operations sharing one device
    interval; 3 all-reduces on the replicate group; nothing on the 4-rank world."""
    steps, layers = 2, 3
    run_layout(bins, (1, 1, 4), "1f1b", INGERO_LAB_STEPS=steps, INGERO_LAB_DEVICE="gpu", INGERO_LAB_SHARDING="fsdp",
               INGERO_LAB_REPLICAS=2, INGERO_LAB_LAYERS=layers, NCCL_PROFILER_PLUGIN=recorders[6], reported="hsdp",
               env_of=lambda r: {"RECORD_PROFILER_OUT": str(tmp_path / f"{r}.rec")})
    for rank in range(4):
        lines = [ln.split() for ln in (tmp_path / f"{rank}.rec").read_text().splitlines()]
        nranks = {int(w[2]): int(w[5]) for w in lines if w[0] == "init"}
        ev = events(lines)
        by_group: dict[int, list] = {}
        for i, e in ev.items():
            if e["type"] == COLL:
                by_group.setdefault(int(e["fields"][-1]), []).append((i, e["fields"][1], nranks[e["ctx"]]))
        launches = sorted(tuple(sorted((f, n) for _, f, n in ops)) for ops in by_group.values())
        want = ([(("AllGather", 2), ("AllGather", 2))] * 2 * layers + [(("ReduceScatter", 2), ("ReduceScatter", 2))]
                * layers + [(("AllReduce", 2),)] * layers) * steps
        assert launches == sorted(want), rank
        stamps: dict[int, set] = {}
        for e in ev.values():
            if e["type"] == KCH:
                stamps.setdefault(e["parent"], set()).add((int(e["fields"][1]), e["states"][0][1]))
        for ops in by_group.values():
            assert len(set().union(*(stamps[i] for i, _, _ in ops))) == 1


def test_the_profiler_sees_megatrons_groups_grouped_exchanges_and_no_world_collective(bins, recorders, tmp_path):
    """NCCL's profiler view (the recording plugin, v6) of tp=2,pp=2,dp=2 under 1F1B: every
    collective is on a 2-rank communicator; per step 8 tensor all-reduces (8192 floats), one
    embedding all-reduce (4096), one reduce-scatter and one all-gather; 3 launches per step hold
    a Send and a Recv to the same peer."""
    steps = 3
    run_layout(bins, (2, 2, 2), "1f1b", INGERO_LAB_STEPS=steps, INGERO_LAB_DEVICE="gpu",
               NCCL_PROFILER_PLUGIN=recorders[6], env_of=lambda r: {"RECORD_PROFILER_OUT": str(tmp_path / f"{r}.rec")})
    for rank in range(8):
        lines = [ln.split() for ln in (tmp_path / f"{rank}.rec").read_text().splitlines()]
        nranks = {int(w[2]): int(w[5]) for w in lines if w[0] == "init"}
        assert sorted(nranks.values()) == [2, 2, 2, 2, 8], nranks    # tensor, data, pipeline, embedding, world
        ev = events(lines).values()
        colls = [e for e in ev if e["type"] == COLL]
        assert {nranks[e["ctx"]] for e in colls} == {2}
        got = sorted((f[1], f[3]) for f in (e["fields"] for e in colls))
        want = sorted([("AllReduce", "8192")] * 8 * steps + [("AllReduce", "4096")] * steps
                      + [("ReduceScatter", "32768")] * steps + [("AllGather", "131072")] * steps)
        assert got == want, rank
        by_group: dict[str, list] = {}
        for e in ev:
            if e["type"] == P2P:
                by_group.setdefault(e["fields"][-1], []).append((e["fields"][0], e["fields"][3]))
        pairs = [g for g in by_group.values()
                 if sorted(f for f, _ in g) == ["Recv", "Send"] and len({p for _, p in g}) == 1]
        assert len(pairs) == 3 * steps and len(by_group) == 5 * steps, (rank, by_group)
