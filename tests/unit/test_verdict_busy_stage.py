"""Pipeline stages on a busy machine: the runqueue wait in a stage's own work is not the stage's.

Two real lab runs of `bench.verdict_lab --cases 3d` (tp=2, pp=2, dp=2, 1F1B) recorded at a load
average of ~45 on two cores, both lab nodes' segments in tests/unit/fixtures:
- busy-3d-clean ("3d clean", no fault): stage 0's ranks own 84 ms/step of work against stage
  1's 71, and 17.5 ms/step more of theirs is runqueue wait (the sched probe's tails): the
  machine starved them, their code did not run longer. Nobody is to be named.
- busy-3d-slow-stage ("3d slow-stage 1": ranks 2, 3, 6, 7 compute 1.5x): the machine starved
  stage 0 so much that both stages' own work reads alike (87 and 91 ms/step); less their
  runqueue wait, stage 1 works 31 ms/step more. Stage 1 is to be named."""

from __future__ import annotations

from pathlib import Path
from statistics import median

from ingero.analysis import analyse
from ingero.readonly_sql import open_source
from ingero.store import build_duckdb

FIXTURES = Path(__file__).parent / "fixtures"


def _report(name: str, tmp_path):
    db = build_duckdb(sorted((FIXTURES / name).iterdir()), tmp_path / "trace.duckdb")
    con = open_source(db)
    try:
        return analyse(con)
    finally:
        con.close()


def _own_by_stage(rep) -> dict:
    return {s: median(r.own_ms for r in rep.ranks if r.stage == s) for s in (0, 1)}


def test_a_stage_slower_only_by_runqueue_wait_is_not_named(tmp_path):
    rep = _report("busy-3d-clean", tmp_path)
    own = _own_by_stage(rep)
    assert own[0] > 1.1 * own[1], own           # the trace shows the starved stage as slower
    s = rep.straggler
    assert s is None or (s.kind == "rank" and s.cause == "cpu-contention"), (
        f"{s.kind} {s.group or s.rank} {s.cause} {s.saving_pct:.1f}%: {s.evidence}")


def test_a_slow_stage_hidden_by_another_stages_runqueue_wait_is_named(tmp_path):
    rep = _report("busy-3d-slow-stage", tmp_path)
    own = _own_by_stage(rep)
    assert abs(own[0] - own[1]) < 0.1 * own[1], own     # own work alone does not tell them apart
    s = rep.straggler
    assert s is not None and s.kind == "stage" and s.ranks == [2, 3, 6, 7], s
    assert s.cause == "compute/unknown" and s.saving_pct >= 5.0, s
