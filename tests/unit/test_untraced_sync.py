"""A synchronisation between steps that the trace does not show (``ingero.analysis.untraced``).

The lab trace in fixtures/lab-gpipe-world is a real run of the lab's tp=2, pp=2, dp=2 GPipe job
with a world all-reduce ending each step (the stop flag), rank 1 computing 2x (138 steps, 2
cores shared with other work). Deleting that all-reduce's rows leaves its timing in the trace
(every rank still waited in it) but not the calls: the ranks of stage 1 then seem to work 88
ms a step instead of 45, and the replay, keeping that "work", found a saving of 11% instead of
32%. The synthetic cases plant the same: a world all-reduce simulated but not written."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from bench.synthetic import pipeline_session
from ingero import schema
from ingero.analysis import analyse

FIXTURE = Path(__file__).parent / "fixtures" / "lab-gpipe-world"
TABLES = ("comms", "nccl_events", "nodes", "ranks", "sched_events", "sched_totals", "sessions", "tcp_events")
SAID = "waits outside NCCL for the last one"


def _lab(delete_world: bool):
    con = duckdb.connect()
    schema.create_all(con)
    for t in TABLES:
        con.execute(f"INSERT INTO {t} BY NAME SELECT * FROM read_parquet('{FIXTURE / t}.parquet')")
    if delete_world:
        world = con.execute("SELECT comm_id_hash FROM nccl_events WHERE nranks = 8 AND op = 'ALL_REDUCE' "
                            "GROUP BY 1").fetchall()
        assert len(world) == 1
        con.execute("DELETE FROM nccl_events WHERE comm_id_hash = ?", [world[0][0]])
    return analyse(con)


def test_a_lab_trace_without_its_world_all_reduce_keeps_rank_cause_and_saving():
    traced, hidden = _lab(False), _lab(True)
    a, b = traced.straggler, hidden.straggler
    assert (a.kind, a.rank, a.cause) == ("rank", 1, "compute/unknown"), a
    assert (b.kind, b.rank, b.cause) == (a.kind, a.rank, a.cause), b
    assert b.saving_ms_per_step == pytest.approx(a.saving_ms_per_step, rel=0.25), (a, b)
    assert not any(SAID in w for w in traced.warnings)
    note = [w for w in hidden.warnings if SAID in w]
    assert note and "136 step boundaries" in note[0], hidden.warnings
    own = {r.rank: r.own_ms for r in hidden.ranks}
    assert max(own[r] for r in (2, 3, 6, 7)) < 1.25 * min(own[r] for r in (0, 4, 5))   # stage 1's wait is no work


def _judged(tmp_path, layout, kw):
    from ingero_operator import gather

    tp, pp, dp, nodes = layout
    gt = pipeline_session(tmp_path / "work" / "nodes", tp, pp, dp, nodes=nodes, steps=12, **kw)
    rep, _ = gather.build_artifact(gather.LocalSession(tmp_path), gt["offsets"])
    return rep, gt


@pytest.mark.parametrize("layout,kw", [
    ((2, 2, 2, 2), {"fault": "slow-rank", "victim": 1, "slow": 1.8, "seed": 5}),
    ((1, 4, 2, 2), {"fault": "slow-rank", "victim": 6, "slow": 1.6, "seed": 7}),
    ((2, 3, 2, 3), {"fault": "cpu-contention", "victim": 9, "slow": 1.7, "seed": 3}),
], ids=["tp2pp2dp2-rank1", "tp1pp4dp2-rank6", "tp2pp3dp2-rank9-cpu"])
def test_a_simulated_world_all_reduce_left_out_of_the_trace_names_the_planted_rank(tmp_path, layout, kw):
    rep, gt = _judged(tmp_path, layout, {**kw, "hidden": ("world",)})
    s = rep.straggler
    assert s is not None and (s.kind, s.rank) == ("rank", kw["victim"]), (s, rep.best_candidate)
    assert s.saving_ms_per_step == pytest.approx(gt["planted_saving_ms"], rel=0.25), (s, gt["planted_saving_ms"])
    assert any(SAID in w for w in rep.warnings), rep.warnings


def test_a_job_without_an_untraced_sync_is_not_given_one(tmp_path):
    """Megatron's 1F1B shape (no collective over every rank, nothing hidden) and a slow rank."""
    kw = {"fault": "slow-rank", "victim": 2, "slow": 1.8, "seed": 4, "schedule": "1f1b", "world": False,
          "dist_opt": True, "embedding": True}
    rep, gt = _judged(tmp_path, (2, 2, 2, 2), kw)
    assert not any(SAID in w for w in rep.warnings), rep.warnings
    assert rep.straggler is not None and rep.straggler.rank == 2
