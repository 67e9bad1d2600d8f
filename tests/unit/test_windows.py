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


def _scale(tmp_path, **kw):
    """A 16-rank data-parallel session (48,000 calls, ~750 steps), rank `victim` late at
    every ALL_REDUCE where `kw` says; its artifact, clock offsets applied."""
    from bench.synthetic import scale_layout, scale_session
    from ingero_operator import gather

    scale_session(tmp_path / "work" / "nodes", ranks=16, collectives=3000, nodes=4, fault="slow-rank",
                  segments_per_node=6, **kw)
    return gather.LocalSession(tmp_path), scale_layout(16, 3000, 4, "slow-rank")


def _table(rep) -> list:
    """A report's table counts: per rank its collectives, calls per op, over the threshold, retransmits."""
    return [(r.rank, r.collectives, {k: v["calls"] for k, v in r.per_op.items()}, r.slow_collectives, r.retransmits)
            for r in rep.ranks]


def test_a_rank_slow_only_in_the_middle_third_is_named_on_a_sample_of_windows(tmp_path, monkeypatch):
    """With a replay budget of a sixth of the session, the sample judges two windows spread
    evenly (centred at a quarter and three quarters of the session: outside the slow third)
    and two where the ranks are most uneven: those find the rank. The session's saving is
    the whole session's within 10%; without the uneven windows nothing is named."""
    from ingero.analysis import windows
    from ingero_operator import gather

    local, lay = _scale(tmp_path, slow_span=(1 / 3, 2 / 3))
    whole, _ = gather.build_artifact(local, lay["offsets"])
    assert whole.straggler is not None and whole.straggler.rank == lay["victim"], whole.straggler
    monkeypatch.setattr(windows, "REPLAY_BUDGET", 8_000)
    monkeypatch.setattr(windows, "SAMPLED_SPREAD", 2)
    runs = {}
    for uneven in (2, 0):
        monkeypatch.setattr(windows, "SAMPLED_UNEVEN", uneven)
        runs[uneven], _ = gather.build_artifact(local, lay["offsets"])
    rep = runs[2]
    assert rep.warnings[0].startswith("judged 4 sampled windows of whole steps"), rep.warnings
    assert "counts are the whole session's" in rep.warnings[0]
    s = rep.straggler
    assert s is not None and (s.rank, s.cause) == (lay["victim"], "compute/unknown"), s
    assert s.evidence.startswith("named in 2 of 4 windows"), s.evidence
    assert s.saving_ms_per_step == pytest.approx(whole.straggler.saving_ms_per_step, rel=0.10)
    assert runs[0].warnings[0].startswith("judged 2 sampled windows"), runs[0].warnings
    assert runs[0].straggler is None or runs[0].straggler.rank != lay["victim"], runs[0].straggler


def test_a_sampled_sessions_counts_are_the_whole_sessions(tmp_path, monkeypatch):
    """Calls per rank and op, collectives over the threshold and retransmits in the table of
    a session judged on a sample of its windows: those of the whole session judged at once."""
    from ingero.analysis import windows
    from ingero_operator import gather

    local, lay = _scale(tmp_path)
    whole, _ = gather.build_artifact(local, lay["offsets"], slow_collective_ms=5.0)
    monkeypatch.setattr(windows, "REPLAY_BUDGET", 8_000)
    rep, _ = gather.build_artifact(local, lay["offsets"], slow_collective_ms=5.0)
    k = windows.SAMPLED_SPREAD + windows.SAMPLED_UNEVEN
    assert rep.warnings[0].startswith(f"judged {k} sampled windows of whole steps ("), rep.warnings
    assert rep.collectives == whole.collectives == 48_000
    assert rep.retransmits == whole.retransmits > 0
    assert _table(rep) == _table(whole)
    assert {r.rank: r.slow_collectives for r in rep.ranks}[lay["victim"]] == 0   # it arrives last: waits least
    assert sum(r.slow_collectives for r in rep.ranks) > 10_000                    # its peers wait 10 ms for it
    assert rep.straggler is not None and rep.straggler.rank == lay["victim"], rep.straggler


def test_windows_of_long_steps_are_fewer_so_that_the_sample_keeps_to_its_budget(tmp_path, monkeypatch):
    """Where MIN_STEPS whole steps hold more than a share of the budget (here ~740 calls of a
    2,000 or 2,600 budget), the sample judges as many windows as the budget holds, two at
    least: one spread, the rest where the ranks are most uneven; the rank is named on each."""
    from ingero.analysis import windows
    from ingero_operator import gather

    local, lay = _scale(tmp_path)
    for budget, judged in ((2_000, 2), (2_600, 3), (8_000, 4)):
        monkeypatch.setattr(windows, "REPLAY_BUDGET", budget)
        rep, _ = gather.build_artifact(local, lay["offsets"])
        assert rep.warnings[0].startswith(f"judged {judged} sampled windows of whole steps"), (budget, rep.warnings)
        s = rep.straggler
        assert s is not None and s.rank == lay["victim"], (budget, s)
        assert s.evidence.startswith(f"named in {judged} of {judged} windows"), (budget, s.evidence)


def test_the_sends_and_receives_before_a_sampled_window_are_counted_as_the_calls_count_them(tmp_path):
    """The pre-pass's sends and receives per (communicator, sender, receiver) before each
    bucket: those ``P2pCounts.add`` counts of the session's calls before its start."""
    from ingero.analysis import analyse_part
    from ingero.analysis.calls import P2pCounts
    from ingero.analysis.sampling import prepass
    from ingero_operator import gather

    tp, pp, dp, nodes = 2, 4, 2, 4
    gt = pipeline_session(tmp_path / "work" / "nodes", tp, pp, dp, nodes=nodes, steps=12, seed=7,
                          fault="slow-rank", victim=2, **SHAPES["1f1b"])
    local = gather.LocalSession(tmp_path)
    gather.build_artifact(local, gt["offsets"])
    con = duckdb.connect(str(local.artifact), read_only=True)
    con.execute(f"SET file_search_path = '{local.root.resolve()}'")
    first, last = con.execute("SELECT min(timestamp_ns), max(timestamp_ns) FROM nccl_events").fetchone()
    pre = prepass(con, first, last, buckets=16)
    calls = analyse_part(con, p2p_before=P2pCounts()).calls
    con.close()
    assert calls is not None
    counted = 0
    for b in (0, 3, 8, 15):
        want = P2pCounts()
        want.add(calls, pre.first + b * pre.width)
        got = pre.p2p_before(b)
        assert (got.sends, got.recvs) == (want.sends, want.recvs), b
        counted += sum(want.sends.values())
    assert counted > 0


def test_a_saving_near_its_floor_is_not_settled_by_the_sample():
    """The sample is judged again on longer windows when the saving over its judged steps of
    a candidate a window named is within SETTLE_PCT of its floor; a saving well clear of it,
    or a near one no window named while another was, is settled."""
    from ingero.analysis.model import Report
    from ingero.analysis.windows import SAVING_FLOOR_PCT, SETTLE_PCT, SPREAD, _unsettled, _Window

    def win(steps: int, named: str | None, **pct) -> _Window:
        rep = Report(ranks=[], straggler=None, step_ms=100.0, collectives=0, retransmits=0, warnings=[])
        rep.mean_step_ms = 100.0
        cands = {k.replace("_", " "): v * 1e6 for k, v in pct.items()}     # % of a 100 ms step: ms = %
        return _Window(rep, steps, cands, named, 100e6, 0, 1)

    near, clear = SAVING_FLOOR_PCT + SETTLE_PCT / 2, SAVING_FLOOR_PCT + 2 * SETTLE_PCT
    assert _unsettled([win(3, "rank 7", rank_7=near + 0.5), win(3, None, rank_7=near - 0.5)])
    assert not _unsettled([win(3, "rank 7", rank_7=clear), win(3, "rank 7", rank_7=clear)])
    assert not _unsettled([win(3, "rank 7", rank_7=clear, rank_2=near), win(3, "rank 7", rank_7=clear)])
    assert _unsettled([win(4, None, rank_2=near, **{SPREAD.replace(" ", "_"): 1.0})])   # none named: the best
    assert not _unsettled([win(0, "rank 7", rank_7=near)])                                # no judged step


def test_sends_and_receives_the_pre_pass_cannot_pair_have_every_step_judged(tmp_path):
    """A trace begun after its communicators were made names no communicator rank for its
    sends and receives (the engine recovers them from the call sequences): the pre-pass
    cannot count those before a window, so the session is judged window after window, as
    one within the budget is, and the report says why there is no sample."""
    from ingero import schema
    from ingero.analysis.sampling import prepass
    from ingero.analysis.windows import analyse_windows
    from ingero_operator import gather

    gt = pipeline_session(tmp_path / "work" / "nodes", 2, 4, 2, nodes=4, steps=12, seed=7, fault="slow-rank",
                          victim=2, **SHAPES["1f1b"])
    local = gather.LocalSession(tmp_path)
    gather.build_artifact(local, gt["offsets"])
    con = duckdb.connect(str(tmp_path / "late.duckdb"))
    con.execute(f"SET file_search_path = '{local.root.resolve()}'")
    con.execute(f"ATTACH '{local.artifact}' AS a (READ_ONLY)")
    for table in schema.TABLES:
        con.execute(f"CREATE TABLE {table} AS SELECT * FROM a.{table}")
    con.execute("DETACH a")
    first, last = con.execute("SELECT min(timestamp_ns), max(timestamp_ns) FROM nccl_events").fetchone()
    p2p = con.execute("SELECT count(*) FROM nccl_events WHERE op IN ('SEND', 'RECV')").fetchone()[0]
    assert prepass(con, first, last).unkeyed == 0
    assert "judged 1 sampled window of whole steps" in analyse_windows(con, budget=1_000).warnings[0]
    con.execute("UPDATE nccl_events SET rank = -1 WHERE op IN ('SEND', 'RECV')")
    assert prepass(con, first, last).unkeyed == p2p > 0
    rep = analyse_windows(con, budget=1_000).to_dict()
    assert rep["warnings"][0] == (f"every step judged, not a sample: {p2p:,} sends and receives are on "
                                  "communicators the trace began after, which only the calls around them pair")
    whole = analyse_windows(con, budget=10**9).to_dict()
    assert {**rep, "warnings": rep["warnings"][1:]} == whole


def test_a_session_with_simulated_groups_has_every_step_judged_and_counts_as_the_engine(tmp_path):
    """The calls of groups closed by ncclGroupSimulateEnd never ran, and the engine leaves
    them out; the pre-pass cannot tell them from the others, so a session over the budget
    with such a group is judged window after window, as one within the budget is: its table
    counts them as the engine does, and the report says why there is no sample."""
    from ingero.analysis import analyse
    from ingero.analysis.windows import analyse_windows
    from tests.unit.test_simulated_group import _merged, _simulate

    con, _ = _merged(tmp_path)
    _simulate(con, 2, 30, before_ns=2_000_000, ret=7)     # non-blocking: NCCL launched it, and both count it
    rep = analyse_windows(con, 5.0, budget=200)
    assert "sampled window" in rep.warnings[0]
    assert _table(rep) == _table(analyse(con, 5.0))
    for step in range(10, 20):
        _simulate(con, 1, step, before_ns=2_000_000)
    whole, rep = analyse(con, 5.0), analyse_windows(con, 5.0, budget=200)
    assert _table(rep) == _table(whole)
    assert rep.warnings[0] == ("every step judged, not a sample: groups closed by ncclGroupSimulateEnd (10 returned "
                               "ncclSuccess) hold calls NCCL never ran, which the counts leave out and only the calls "
                               "around them tell apart")
    assert {**rep.to_dict(), "warnings": rep.warnings[1:]} == whole.to_dict()


def test_an_op_no_sampled_window_held_is_counted_with_no_durations(tmp_path):
    """Broadcasts made only before the first step are in no window the sample judged: the
    table counts their calls as the engine does, and has no p50/p99 for them (None; null in
    JSON), not 0 ms."""
    import io
    import json

    from ingero.analysis import analyse
    from ingero.analysis.model import Report
    from ingero.analysis.windows import analyse_windows
    from ingero.report_text import render
    from tests.unit.test_simulated_group import _merged

    con, _ = _merged(tmp_path)
    eid = con.execute("SELECT max(event_id) FROM nccl_events").fetchone()[0]
    firsts = con.execute("SELECT global_rank, any_value(node), any_value(pid), any_value(nranks), min(timestamp_ns) "
                         "FROM nccl_events GROUP BY ALL ORDER BY 1").fetchall()
    con.executemany("""INSERT INTO nccl_events (event_id, node, pid, tid, global_rank, rank, nranks, timestamp_ns,
                       duration_ns, op, comm_id_hash, seq, ret, count, bytes)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, 50000, 'BROADCAST', 2989, ?, 0, 262144, 1048576)""",
                    [(eid + 2 * g + i + 1, node, pid, pid, g, g, world, t - (2 - i) * 1_000_000, i)
                     for g, node, pid, world, t in firsts for i in range(2)])
    whole, rep = analyse(con), analyse_windows(con, budget=200)
    assert "sampled window" in rep.warnings[0], rep.warnings
    assert _table(rep) == _table(whole)
    for r, w in zip(rep.ranks, whole.ranks):
        assert r.per_op["BROADCAST"] == {"calls": 2, "p50_ms": None, "p99_ms": None}
        assert w.per_op["BROADCAST"]["p50_ms"] == pytest.approx(0.05)
        assert all(v["p50_ms"] > 0 and v["p99_ms"] > 0 for op, v in r.per_op.items() if op != "BROADCAST")
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["ranks"][0]["per_op"]["BROADCAST"] == {"calls": 2, "p50_ms": None, "p99_ms": None}
    assert Report.from_dict(d).to_dict() == rep.to_dict()
    render(rep, io.StringIO())


def _window_saving(con, calls, victim: int, lo: int, hi: int) -> float:
    """The saving (ms/step) of fixing `victim` replayed on the window [lo, hi) of the session
    on `con`, its sends and receives paired with those of `calls` before it."""
    from ingero.analysis import analyse_part
    from ingero.analysis.calls import P2pCounts
    from ingero.analysis.windows import events_between

    pairs = P2pCounts()
    pairs.add(calls, lo)
    with events_between(con, lo, hi):
        d = analyse_part(con, hang=False, p2p_before=pairs).decision
    assert d is not None
    return next(k.saving_ns for k in d.candidates if k.label == f"rank {victim}") / 1e6


@pytest.mark.parametrize("world", [True, False])
def test_a_window_replays_a_slow_stage0_ranks_whole_saving_at_any_cut(tmp_path, world):
    """A constant slow rank saves as much per step in a window as over the session, wherever
    the window's edges cut the steps. With a world all-reduce ending each step, a window may
    end after every rank's call of one but the last arrivers', the slow rank's and its stage's
    (which wait for it): a boundary that waits on calls the window does not hold, which no
    replay can move (that step saves 6.9 of 21 ms). Without one, each stage's own
    data-parallel all-reduce marks its steps, at another point of the step than the stage-0
    rank's: a fix of the rank's whole steps only loses the part of its cut steps between a
    later stage's boundaries (16.9 ms/step on 3-step windows against 21.1 over the session)."""
    from ingero.analysis import analyse_part
    from ingero.analysis.calls import P2pCounts
    from ingero.readonly_sql import open_source

    pipeline_session(tmp_path, 2, 4, 2, nodes=2, steps=12, fault="slow-rank", victim=0, world=world)
    con = open_source(tmp_path)
    whole = analyse_part(con, p2p_before=P2pCounts())
    assert whole.report.straggler is not None and whole.calls is not None
    want = whole.report.straggler.saving_ms_per_step
    if world:
        ar = con.execute("SELECT seq, min(timestamp_ns), max(timestamp_ns) FILTER (rank = 0) FROM nccl_events "
                         "WHERE nranks = 16 GROUP BY seq ORDER BY seq").fetchall()
        lo = (ar[1][1] + ar[2][1]) // 2
        got = [_window_saving(con, whole.calls, 0, lo, ar[7][2])]     # ar[7] but stage 0's calls
    else:
        first = con.execute("SELECT min(timestamp_ns) FROM nccl_events").fetchone()[0]
        step = whole.report.step_ms * 1e6
        got = [_window_saving(con, whole.calls, 0, int(first + f * step), int(first + (f + 4.6) * step))
               for f in np.arange(1.0, 6.0, 0.5)]
    assert float(np.mean(got)) == pytest.approx(want, rel=0.05), got
    assert got == pytest.approx([want] * len(got), rel=0.1), got
