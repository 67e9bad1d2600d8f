"""The shape of the lab's layout job as real eBPF sees it: Megatron's groups and 1F1B.

`ingero lab run --layout ... --schedule 1f1b` (worker.c run_layout), traced. From
nccl_events alone: every pipeline send and receive sits in a group, as
batch_isend_irecv makes it, and the steady state's groups hold a send to and a
receive from the same neighbour; each (d, t) has an embedding all-reduce of its
first and last stage once per step; each stage's data-parallel group
reduce-scatters and all-gathers once per step; the tensor groups all-reduce once
per forward and backward of each microbatch; and no collective spans the world
(the world communicator is created, split and destroyed, nothing more)."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from tests.conftest import bpf_reason

pytestmark = pytest.mark.bpf

STEPS, M = 12, 4
COLLECTIVES = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "BROADCAST", "REDUCE")


def _traced(tmp_path, layout: str, nodes: int, rpn: int, device: str) -> tuple[dict, list[tuple]]:
    reason = bpf_reason()
    if reason:
        pytest.skip(reason)
    from ingero.lab.runner import LabConfig
    from ingero.lab.tracers import run_traced
    from ingero.readonly_sql import open_source

    cfg = LabConfig(scenario="clean", nodes=nodes, ranks_per_node=rpn, steps=STEPS, compute_ms=20.0,
                    layout=layout, microbatches=M, schedule="1f1b", device=device, out_dir=tmp_path)
    run = run_traced(cfg)
    assert set(run.codes.values()) == {0}, f"rank exit codes {run.codes}; logs in {tmp_path / 'logs'}"
    assert set(run.stops.values()) == {0}, run.stops_told()
    assert {r["stats"]["steps"] for r in run.report["ranks"]} == {STEPS}
    con = open_source(run.db)
    try:
        rows = con.execute("""
            SELECT global_rank, op, nranks, comm_id_hash, peer FROM nccl_events
            ORDER BY global_rank, timestamp_ns, event_id""").fetchall()
    finally:
        con.close()
    return run.report, rows


def _comms(rows) -> dict[tuple[int, str], list[int]]:
    """(communicator, op) -> the ranks that called it, one entry per call."""
    members = defaultdict(set)
    for rank, _op, _n, comm, _peer in rows:
        if comm is not None:
            members[comm].add(rank)
    calls = defaultdict(list)
    for rank, op, _n, comm, _peer in rows:
        if op in COLLECTIVES:
            calls[(tuple(sorted(members[comm])), op)].append(rank)
    return calls


def _groups(rows) -> dict[int, list[list[tuple]]]:
    """Per rank, the (op, peer) calls of each GROUP_START..GROUP_END, and the sends or
    receives called outside any group (as a group of their own, marked None)."""
    out: dict[int, list] = defaultdict(list)
    open_: dict[int, list | None] = {}
    for rank, op, _n, _comm, peer in rows:
        if op == "GROUP_START":
            open_[rank] = []
        elif op == "GROUP_END":
            out[rank].append(open_.pop(rank))
        elif op in ("SEND", "RECV"):
            if open_.get(rank) is None:
                out[rank].append(None)
            else:
                open_[rank].append((op, peer))
    return out


def _no_world_collective(rows, world: int) -> None:
    big = Counter(op for _r, op, n, _c, _p in rows if n == world)
    assert set(big) <= {"COMM_INIT_RANK", "COMM_DESTROY"}, big


def _rank(t: int, p: int, d: int, T: int, P: int) -> int:
    return d * P * T + p * T + t


# the GPU-like device (its host runs ahead of the device); the CPU device's traced 1F1B job
# is tests/bpf/test_lab_layout.py's (send/recv pairing, stages, verdicts)
@pytest.mark.parametrize("device", ["gpu"])
def test_a_1f1b_3d_job_groups_its_exchanges_and_has_megatrons_groups_but_no_world_collective(tmp_path, device):
    T, P, D = 2, 2, 2
    lab, rows = _traced(tmp_path, "tp=2,pp=2,dp=2", 2, 4, device)
    _no_world_collective(rows, T * P * D)
    groups = _groups(rows)
    for rank in range(T * P * D):
        gs = groups[rank]
        assert None not in gs, f"rank {rank}: a send or receive outside a group"
        pairs = [g for g in gs if sorted(op for op, _ in g) == ["RECV", "SEND"] and len({p for _, p in g}) == 1]
        # P = 2, M = 4: stage 0 warms up 1 microbatch, so 3 steady-state pairs per step each side
        assert len(pairs) == 3 * STEPS, (rank, Counter(tuple(sorted(g)) for g in gs))
        assert len(gs) == 5 * STEPS, (rank, len(gs))
    calls = _comms(rows)
    for d in range(D):
        for t in range(T):
            emb = (_rank(t, 0, d, T, P), _rank(t, P - 1, d, T, P))
            assert Counter(calls[(emb, "ALL_REDUCE")]) == {r: STEPS for r in emb}, (emb, calls.keys())
    for p in range(P):
        for t in range(T):
            dp = tuple(_rank(t, p, d, T, P) for d in range(D))
            for op in ("REDUCE_SCATTER", "ALL_GATHER"):
                assert Counter(calls[(dp, op)]) == {r: STEPS for r in dp}, (dp, op)
        for d in range(D):
            tp = tuple(_rank(t, p, d, T, P) for t in range(T))
            assert Counter(calls[(tp, "ALL_REDUCE")]) == {r: 2 * M * STEPS for r in tp}, tp


def test_a_tp_dp_job_without_a_pipeline_has_tensor_and_data_groups_only(tmp_path):
    T, D = 2, 2
    lab, rows = _traced(tmp_path, "tp=2,pp=1,dp=2", 2, 2, "cpu")
    _no_world_collective(rows, T * D)
    assert not [r for r in rows if r[1] in ("SEND", "RECV", "GROUP_START")]
    calls = _comms(rows)
    assert {k for k in calls} == {((0, 1), "ALL_REDUCE"), ((2, 3), "ALL_REDUCE"),
                                  ((0, 2), "REDUCE_SCATTER"), ((0, 2), "ALL_GATHER"),
                                  ((1, 3), "REDUCE_SCATTER"), ((1, 3), "ALL_GATHER")}, calls.keys()
    assert Counter(calls[((0, 1), "ALL_REDUCE")]) == {0: 2 * M * STEPS, 1: 2 * M * STEPS}
    assert Counter(calls[((1, 3), "ALL_GATHER")]) == {1: STEPS, 3: STEPS}
