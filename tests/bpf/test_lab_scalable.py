"""Acceptance (issue 12): a lab job with more ranks than TORCH_NCCL_RANKS_PER_ROOT
(set to 2 here; 2 nodes x 2 ranks) builds its world with ncclCommInitRankScalable,
as PyTorch does, and is traced completely: every rank's calls carry a non-zero
communicator hash and a resolved rank, on real eBPF."""

from __future__ import annotations

import os

import pytest

from tests.conftest import bpf_reason

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def scalable(tmp_path_factory):
    reason = bpf_reason()
    if reason:
        pytest.skip(reason)
    from ingero.lab.runner import LabConfig
    from ingero.lab.tracers import run_traced
    from ingero.readonly_sql import open_source

    out = tmp_path_factory.mktemp("scalable")
    old = os.environ.get("TORCH_NCCL_RANKS_PER_ROOT")
    os.environ["TORCH_NCCL_RANKS_PER_ROOT"] = "2"   # the workers inherit it
    try:
        run = run_traced(LabConfig(scenario="clean", nodes=2, ranks_per_node=2, seconds=4, out_dir=out))
    finally:
        if old is None:
            os.environ.pop("TORCH_NCCL_RANKS_PER_ROOT", None)
        else:
            os.environ["TORCH_NCCL_RANKS_PER_ROOT"] = old
    assert set(run.codes.values()) == {0}, f"rank exit codes {run.codes}"
    assert set(run.stops.values()) == {0}, run.stops_told()
    con = open_source(run.db)
    yield con
    con.close()


def test_above_ranks_per_root_every_rank_creates_its_world_with_scalable_init(scalable):
    rows = scalable.execute("""SELECT global_rank, rank, nranks, comm_id_hash, ret FROM nccl_events
                               WHERE op = 'COMM_INIT_RANK_SCALABLE' ORDER BY 1""").fetchall()
    assert [(g, r, n, ret) for g, r, n, _, ret in rows] == [(g, g, 4, 0) for g in range(4)]
    assert len({h for *_, h, _ in rows}) == 1 and rows[0][3] != 0
    assert scalable.execute("SELECT COUNT(*) FROM nccl_events WHERE op = 'COMM_INIT_RANK'").fetchone() == (0,)


def test_every_call_of_every_rank_on_a_scalable_world_has_a_hash_and_a_resolved_rank(scalable):
    per_rank = scalable.execute("""
        SELECT global_rank, COUNT(*), COUNT(*) FILTER (WHERE comm_id_hash = 0 OR rank < 0)
        FROM nccl_events WHERE op IN ('ALL_REDUCE', 'ALL_GATHER', 'REDUCE_SCATTER', 'BROADCAST',
                                      'SEND', 'RECV')
        GROUP BY 1 ORDER BY 1""").fetchall()
    assert [g for g, _, _ in per_rank] == [0, 1, 2, 3]
    assert all(n > 0 and bad == 0 for _, n, bad in per_rank), per_rank
    # the all-reduce runs on the scalable world: same hash as its init on every rank
    world = scalable.execute("SELECT DISTINCT comm_id_hash FROM nccl_events "
                             "WHERE op = 'COMM_INIT_RANK_SCALABLE'").fetchall()
    ar = scalable.execute("SELECT DISTINCT comm_id_hash, nranks FROM nccl_events WHERE op = 'ALL_REDUCE'").fetchall()
    assert ar == [(world[0][0], 4)]
    # the per-node split of the scalable world resolves to ranks 0..1 of 2
    rs = scalable.execute("""SELECT DISTINCT global_rank, rank, nranks FROM nccl_events
                             WHERE op = 'REDUCE_SCATTER' ORDER BY 1""").fetchall()
    assert rs == [(0, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 2)]
    assert scalable.execute("SELECT COUNT(DISTINCT pid) FROM ranks WHERE rank >= 0").fetchone() == (4,)
