"""bench/synthetic.py's data-parallel scale session is a trace a real job could write: each
rank issues its calls in program order, each after its previous call returned, also when
the planted victim is late, so the replay of its calls meets no cycle."""

from __future__ import annotations

import duckdb
import numpy as np

from bench.synthetic import SCALE_STEP, scale_layout, scale_session


def test_a_late_victim_pushes_its_later_calls_back_and_the_replay_meets_no_cycle(tmp_path):
    from ingero_operator import gather

    ranks, collectives, nodes = 8, 400, 2
    scale_session(tmp_path / "work" / "nodes", ranks=ranks, collectives=collectives, nodes=nodes,
                  fault="slow-rank", segments_per_node=2)
    lay = scale_layout(ranks, collectives, nodes, "slow-rank")
    rows = duckdb.sql(f"SELECT global_rank, timestamp_ns, duration_ns, op::VARCHAR AS op FROM "
                      f"read_parquet('{tmp_path}/work/nodes/*/nccl_events/*.parquet') "
                      f"ORDER BY global_rank, timestamp_ns").fetchnumpy()
    program = [s[0] for s in SCALE_STEP] * (collectives // len(SCALE_STEP))
    for r in range(ranks):
        mine = rows["global_rank"] == r
        start = rows["timestamp_ns"][mine].astype(np.int64)
        end = start + rows["duration_ns"][mine].astype(np.int64)
        assert list(rows["op"][mine]) == program, f"rank {r}: its calls out of program order"
        early = np.nonzero(start[1:] < end[:-1])[0]
        assert not len(early), f"rank {r}: call {early[:3] + 1} starts before the previous one ends"
    rep, _ = gather.build_artifact(gather.LocalSession(tmp_path), lay["offsets"])
    assert not [w for w in rep.warnings if "cycle" in w], rep.warnings
    assert rep.straggler is not None and (rep.straggler.rank, rep.straggler.cause) == (lay["victim"], "compute/unknown")
