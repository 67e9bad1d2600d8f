"""A session judged in windows of whole steps (ingero.analysis.windows) says what the whole
session judged at once says: the same rank, group or node, the same cause, the same saving
within a few percent, on seven cases of the ground-truth matrix (tests/unit/test_verdict_matrix.py)
three times as long, judged in three windows."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from bench.synthetic import pipeline_session

SHAPES = {"gpipe": {}, "1f1b": {"schedule": "1f1b", "world": False, "dist_opt": True, "embedding": True},
          "fsdp": {"fsdp": 4, "replicas": 1, "world": False}}
# (tp, pp, dp, nodes), shape, fault and its figures
CASES = [
    ((1, 4, 2, 2), "1f1b", {"fault": "slow-rank", "victim": 2, "slow": 1.5}),
    ((2, 1, 4, 2), "fsdp", {"fault": "slow-rank", "victim": 6, "slow": 1.6}),
    ((2, 2, 2, 2), "1f1b", {"fault": "cpu-contention", "victim": 3, "slow": 1.7}),
    ((2, 2, 4, 4), "1f1b", {"fault": "slow-node", "lossy_node": 1, "slow": 1.5}),
    ((4, 2, 2, 4), "gpipe", {"fault": "network", "lossy_node": 2, "loss_ms": 3.0}),
    ((2, 2, 2, 2), "1f1b", {"fault": "imbalance"}),
    ((2, 2, 2, 2), "gpipe", {"fault": "clean"}),
]
STEPS = 36
WINDOWS = 3


def _ids():
    return [f"tp{t}pp{p}dp{d}-{shape}-{kw['fault']}" for (t, p, d, _), shape, kw in CASES]


@pytest.mark.parametrize("layout,shape,kw", CASES, ids=_ids())
def test_a_session_judged_in_windows_names_what_the_whole_session_names(tmp_path, layout, shape, kw):
    from ingero_operator import gather

    tp, pp, dp, nodes = layout
    skew = [int(x) for x in np.random.default_rng(tp * 100 + pp * 10 + dp).integers(-5_000_000, 5_000_000, nodes)]
    gt = pipeline_session(tmp_path / "work" / "nodes", tp, pp, dp, nodes=nodes, steps=STEPS, seed=7, skew_ns=skew,
                          **kw, **SHAPES[shape])
    local = gather.LocalSession(tmp_path)
    whole, _ = gather.build_artifact(local, gt["offsets"])
    con = duckdb.connect(str(local.artifact), read_only=True)
    con.execute(f"SET file_search_path = '{local.root.resolve()}'")
    calls = con.execute("SELECT count(*) FROM nccl_events").fetchone()[0]
    con.close()
    part, _ = gather.build_artifact(local, gt["offsets"], window_calls=calls // WINDOWS + 1)
    assert not any("windows of whole steps" in w for w in whole.warnings)
    assert part.warnings[0].startswith(f"judged in {WINDOWS} windows of whole steps"), part.warnings
    # each step judged once: the steps of the windows are the whole session's
    assert f"({STEPS - 1} steps in all)" in part.warnings[0], part.warnings[0]
    assert [r.collectives for r in part.ranks] == [r.collectives for r in whole.ranks]
    assert part.mean_step_ms == pytest.approx(whole.mean_step_ms, rel=0.03)
    w, p = whole.straggler, part.straggler
    where = f"whole: {w}; windows: {p}"
    if w is None:
        assert p is None, where
        assert part.best_saving_pct == pytest.approx(whole.best_saving_pct, abs=2.0), where
        return
    assert p is not None, where
    assert (p.kind, sorted(p.ranks), p.cause) == (w.kind, sorted(w.ranks), w.cause), where
    if w.kind == "rank":       # a group names its worst rank, which may differ from window to window
        assert (p.rank, p.node) == (w.rank, w.node), where
    assert p.saving_ms_per_step == pytest.approx(w.saving_ms_per_step, rel=0.10), where


def test_an_artifact_judged_in_windows_reads_each_call_once_from_the_segments_in_range(tmp_path):
    """The operator's windows read only the segments whose time range meets theirs; `ingero
    report` judges the artifact in the same windows through its read-only views, from the
    segments it lists, or through the whole views where it lists none (an older artifact):
    each gives the same report, every call counted once."""
    import duckdb

    from bench.synthetic import scale_layout, scale_session
    from ingero.readonly_sql import open_source
    from ingero.segment_views import SegmentViews, analyse_trace
    from ingero_operator import gather

    ranks, collectives, nodes = 16, 600, 4
    scale_session(tmp_path / "work" / "nodes", ranks=ranks, collectives=collectives, nodes=nodes,
                  fault="slow-rank", segments_per_node=6)
    lay = scale_layout(ranks, collectives, nodes, "slow-rank")
    local = gather.LocalSession(tmp_path)
    window = ranks * collectives // 4
    rep, _ = gather.build_artifact(local, lay["offsets"], window_calls=window)
    assert rep.warnings[0].startswith("judged in "), rep.warnings
    assert sum(r.collectives for r in rep.ranks) == ranks * collectives
    assert rep.straggler is not None and rep.straggler.rank == lay["victim"], rep.straggler
    for listed in (True, False):
        if not listed:
            with duckdb.connect(str(local.artifact)) as rw:
                rw.execute("DROP TABLE segments")
        con = open_source(tmp_path)
        try:
            assert (SegmentViews.stored(con) is not None) == listed
            again = analyse_trace(con, window_calls=window)
            assert con.execute("SELECT count(*) FROM nccl_events").fetchone()[0] == ranks * collectives
        finally:
            con.close()
        assert again.to_dict() == rep.to_dict()
