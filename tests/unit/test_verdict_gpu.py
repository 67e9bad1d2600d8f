"""The verdict on GPU jobs: device times from the NCCL profiler plugin when every rank has
them; host enqueue times only (a call returns once its work is queued) otherwise, where
the report says so and draws no network verdict from host windows.

Sessions from ``bench.synthetic.pipeline_session(gpu=...)``: the host calls are written as a
GPU job makes them (20 us, up to 3 ms ahead of the device), and with gpu="plugin" the
plugin's rows carry the simulated device times, NCCL's comm hash and per-function seq."""

from __future__ import annotations

import duckdb
import pytest

from bench.synthetic import pipeline_session
from ingero.analysis import analyse
from ingero.cli import main
from ingero.readonly_sql import open_source


def _run(tmp_path, **kw):
    gt = pipeline_session(tmp_path, 2, 2, 2, nodes=2, steps=12, **kw)
    return analyse(open_source(tmp_path)), gt


def test_with_the_plugin_a_slow_rank_is_judged_on_device_times(tmp_path):
    rep, gt = _run(tmp_path, fault="slow-rank", victim=5, gpu="plugin")
    assert rep.timing == "device"
    s = rep.straggler
    assert (s.kind, s.rank, s.cause) == ("rank", 5, "compute/unknown"), s
    assert s.saving_ms_per_step == pytest.approx(gt["planted_saving_ms"], rel=0.25)
    assert not any("host" in w for w in rep.warnings), rep.warnings


def test_with_the_plugin_a_lossy_link_is_judged_in_device_windows(tmp_path):
    rep, gt = _run(tmp_path, fault="network", lossy_node=1, loss_ms=3.0, gpu="plugin")
    assert rep.timing == "device"
    s = rep.straggler
    assert (s.cause, s.node) == ("network", gt["lossy_node"]), s
    assert s.saving_ms_per_step == pytest.approx(gt["planted_saving_ms"], rel=0.25)


def test_without_the_plugin_host_enqueue_times_are_said_and_never_blame_the_network(tmp_path, capsys):
    rep, gt = _run(tmp_path, fault="network", lossy_node=1, loss_ms=3.0, gpu="host")
    assert rep.timing == "host-enqueue"
    assert rep.straggler is None or rep.straggler.cause != "network", rep.straggler
    assert any("host time is enqueue time" in w and "profiler plugin" in w for w in rep.warnings), rep.warnings
    assert sum(r.retransmits for r in rep.ranks) == rep.retransmits > 0     # still counted, per rank
    assert all(r.retransmits_in_window == 0 for r in rep.ranks)            # but in no host window
    assert main(["report", str(tmp_path)]) == 0
    assert "timing: host enqueue times only" in capsys.readouterr().out


def test_a_cpu_nccl_is_judged_on_host_times_without_a_warning(tmp_path):
    rep, gt = _run(tmp_path, fault="network", lossy_node=1, loss_ms=3.0)
    assert rep.timing == "host" and rep.straggler.cause == "network"
    assert not any("enqueue" in w for w in rep.warnings)


def test_device_times_for_only_some_ranks_fall_back_to_host_times_with_a_warning(tmp_path):
    pipeline_session(tmp_path, 2, 2, 2, nodes=2, steps=12, fault="slow-rank", victim=5, gpu="plugin")
    con = open_source(tmp_path)
    # the plugin was not loaded on node-b: drop its rows from a copy of the trace
    db = tmp_path / "partial.duckdb"
    out = duckdb.connect(str(db))
    from ingero import schema
    schema.create_all(out)
    for t in ("nccl_events", "nccl_profiler_events", "ranks", "sched_totals"):
        rows = con.execute(f"SELECT * FROM {t}" + (" WHERE node = 'node-a'" if t == "nccl_profiler_events" else "")
                           ).to_arrow_table()
        out.register("src", rows)
        cols = ", ".join(f'"{c}"' for c in rows.column_names)
        out.execute(f"INSERT INTO {t} ({cols}) SELECT {cols} FROM src")
        out.unregister("src")
    out.close()
    con.close()
    rep = analyse(open_source(db))
    assert rep.timing != "device"
    assert any("device times cover 4 of 8 ranks" in w and "rank 4" in w for w in rep.warnings), rep.warnings
