"""A collective made only at start-up marks no step: a DDP job broadcasts its parameters a
few times at init, and those few instances are the collective made least often
(ingero/analysis/steps.py, ``markers``; the pre-pass's step, sampling.py).

The trace is bench/synthetic.py's slow-rank session, merged as the operator merges it
(test_simulated_group.py), with 3 broadcasts per rank 1 ms apart before its first call.
"""

from __future__ import annotations

import numpy as np
import pytest

from ingero.analysis import analyse, sampling
from ingero.analysis.windows import analyse_windows
from tests.unit.test_simulated_group import AR_COMM, _merged


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    con, lay = _merged(tmp_path_factory.mktemp("merged"))
    eid, t0 = con.execute("SELECT max(event_id), min(timestamp_ns) FROM nccl_events").fetchone()
    ranks = con.execute("SELECT DISTINCT global_rank, rank, nranks, node, pid, tid, session_id FROM nccl_events").fetchall()
    rows = [(eid + 1 + 3 * i + s, t0 - (4 - s) * 1_000_000, "BROADCAST", 0xB0B, s, *r)
            for i, r in enumerate(ranks) for s in range(3)]
    con.executemany("""INSERT INTO nccl_events (event_id, timestamp_ns, op, comm_id_hash, seq, global_rank, rank,
                       nranks, node, pid, tid, session_id, duration_ns, count, bytes, ret)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 50000, 262144, 1048576, 0)""", rows)
    lo, hi, n = con.execute("SELECT min(timestamp_ns), max(timestamp_ns), count(DISTINCT seq) FROM nccl_events "
                            "WHERE comm_id_hash = ? AND global_rank = 0", [AR_COMM]).fetchone()
    return con, lay, (hi - lo) / (n - 1)


def test_a_collective_made_only_at_start_up_marks_no_step(job):
    con, lay, step_ns = job
    rep = analyse(con)
    assert rep.step_ms == pytest.approx(step_ns / 1e6, rel=0.05)
    assert rep.straggler is not None and rep.straggler.rank == lay["victim"]


def test_the_pre_pass_steps_by_a_collective_made_through_the_session(job):
    con, _, step_ns = job
    first, last = con.execute("SELECT min(timestamp_ns), max(timestamp_ns) FROM nccl_events").fetchone()
    assert sampling.prepass(con, first, last).step_ns == pytest.approx(step_ns, rel=0.05)



def test_the_pre_pass_passes_over_start_up_collectives_before_an_idle_start():
    """Ranks 0 and 1 broadcast 3 times in the first bucket, then make one all-reduce a
    bucket from bucket 40 on (the first step compiled): the step is the all-reduce's."""
    steps = np.arange(40, 64)
    b = np.r_[0, 0, steps, steps]
    rank = np.r_[0, 1, [0] * len(steps), [1] * len(steps)]
    op = np.array(["BROADCAST"] * 2 + ["ALL_REDUCE"] * 2 * len(steps), dtype=object)
    comm = np.where(op == "BROADCAST", 0xB0B, 0xA).astype(np.uint64)
    n = np.r_[3, 3, np.ones(2 * len(steps), np.int64)]
    assert sampling._least_recurring(b, comm, op, rank, n) == len(steps)


def test_a_window_holding_the_start_up_judges_its_whole_steps(job):
    con, lay, _ = job
    rep = analyse_windows(con, window_calls=200)
    assert rep.warnings[0] == "judged in 3 windows of whole steps (59 steps in all)"     # the 60 all-reduces' 59
    assert rep.straggler is not None and rep.straggler.rank == lay["victim"]
