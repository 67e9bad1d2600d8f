"""The verdict on a real tensor x pipeline x data parallel lab job whose rank 1 shares its CPU
with a noisy neighbour (the lab's cpu-hog, ingero/lab/faults.py start_hogs), traced with
real eBPF: 8 ranks on 2 lab nodes on a 2-core machine, 7 of them on the other core.

The victim is in stage 0 and its tensor-parallel partner, rank 0, waits on it inside their
all-reduce: the verdict must name rank 1 itself, with cpu-contention as the cause, and a
saving over the floor."""

from __future__ import annotations

import pytest

from tests.conftest import background_load, bpf_reason

pytestmark = pytest.mark.bpf


def test_a_cpu_starved_rank_of_the_layout_job_is_named_with_cpu_contention(tmp_path):
    reason = bpf_reason()
    if reason:
        pytest.skip(reason)
    from ingero.analysis import analyse
    from ingero.analysis.verdict import SAVING_FLOOR_PCT
    from ingero.lab.runner import LabConfig
    from ingero.lab.tracers import run_traced
    from ingero.readonly_sql import open_source

    cfg = LabConfig(scenario="cpu-hog", nodes=2, ranks_per_node=4, layout="tp=2,pp=2,dp=2", victim_rank=1,
                    steps=30, compute_ms=40.0, out_dir=tmp_path, background_load=background_load())
    run = run_traced(cfg)
    assert set(run.codes.values()) == {0}, f"rank exit codes {run.codes}; logs in {tmp_path / 'logs'}"
    assert set(run.stops.values()) == {0}, run.stops_told()
    assert run.report["cpu_hog"]["loops"] == cfg.hogs, run.report["cpu_hog"]
    from ingero.lab import cgroups
    if (cgroups.CPU_V1_ROOT / "cpu.shares").exists():     # the weight holds against the victim only
        assert run.report["cpu_hog"].get("cpu_shares") == round(1024 * cfg.hog_weight), run.report["cpu_hog"]
    con = open_source(run.db)
    try:
        rep = analyse(con)
    finally:
        con.close()
    s = rep.straggler
    assert s is not None and (s.kind, s.rank, s.cause) == ("rank", 1, "cpu-contention"), (s, rep.best_candidate)
    assert SAVING_FLOOR_PCT < s.saving_pct < 100.0 and s.saving_ms_per_step < rep.mean_step_ms, s
    assert "runqueue" in s.evidence, s.evidence
