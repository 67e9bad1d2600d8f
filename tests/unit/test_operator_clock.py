"""Clock offsets: NTP-style estimation, and their application when segments are merged."""

from __future__ import annotations

import re

import duckdb
import pytest

from ingero import schema
from ingero.store import SegmentWriter
from ingero.readonly_sql import open_source
from ingero_operator.agents import ClockSample, estimate_offset
from ingero_operator import gather
from ingero.analysis import analyse_part
from ingero_operator.gather import LocalSession, build_artifact, ingest_and_analyse


def test_offset_is_agent_time_minus_the_midpoint_of_the_round_trip():
    s = ClockSample(t0_ns=1_000, agent_ns=5_600, t1_ns=2_000)
    assert s.rtt_ns == 1_000 and s.offset_ns == 4_100


def test_the_sample_with_the_lowest_round_trip_wins():
    true_offset = 250_000_000   # the node is 250 ms ahead
    samples = [
        ClockSample(0, 0 + true_offset + 9_000_000, 10_000_000),          # slow reply, asymmetric delay
        ClockSample(20_000_000, 20_000_100 + true_offset, 20_000_200),    # 200 ns round trip
        ClockSample(30_000_000, 30_000_000 + true_offset - 4_000_000, 38_000_000),
    ]
    offset, rtt = estimate_offset(samples)
    assert rtt == 200 and offset == true_offset


def test_no_usable_sample_is_an_error():
    with pytest.raises(ValueError):
        estimate_offset([ClockSample(10, 5, 0)])


def _node(local: LocalSession, node: str, ts: list[int]):
    w = SegmentWriter(local.node_dir(node), node, "s")
    w.append("nccl_events", {"timestamp_ns": ts, "duration_ns": [1] * len(ts), "op": ["ALL_REDUCE"] * len(ts),
                             "comm_id_hash": [7] * len(ts), "seq": list(range(len(ts))), "pid": [1] * len(ts),
                             "global_rank": [0 if node == "a" else 1] * len(ts), "ret": [0] * len(ts)})
    w.append("tcp_events", {"timestamp_ns": [ts[0]], "event": ["tcp_retransmit_skb"], "pid": [1]})
    w.put_rows("nodes", [{"lost_nccl": 0}])
    w.flush()


def test_merge_shifts_each_nodes_timestamps_by_its_offset(tmp_path):
    local = LocalSession(tmp_path / "ns" / "job")
    # Node b's clock runs 3 s ahead: the same instants carry timestamps 3 s later.
    _node(local, "a", [10_000_000_000, 10_100_000_000])
    _node(local, "b", [13_000_000_000, 13_100_000_000])
    build_artifact(local, {"a": 0, "b": 3_000_000_000})
    con = open_source(local.artifact)
    rows = con.execute("SELECT node, seq, timestamp_ns FROM nccl_events ORDER BY node, seq").fetchall()
    assert rows == [("a", 0, 10_000_000_000), ("a", 1, 10_100_000_000),
                    ("b", 0, 10_000_000_000), ("b", 1, 10_100_000_000)]
    assert con.execute("SELECT node, timestamp_ns FROM tcp_events ORDER BY node").fetchall() == \
        [("a", 10_000_000_000), ("b", 10_000_000_000)]
    assert con.execute("SELECT node, clock_offset_ns FROM nodes ORDER BY node").fetchall() == \
        [("a", 0), ("b", 3_000_000_000)]
    con.close()
    rep, _ = build_artifact(local, {"a": 0, "b": 3_000_000_000})
    assert max(r.late_ms for r in rep.ranks) < 1e-6   # aligned: nobody is late


def test_live_ingest_shifts_each_nodes_clock_columns_whatever_columns_its_files_hold(tmp_path, monkeypatch):
    """Node b's clock runs 3 s ahead and its agent writes no `pod` nor `stream` (an older agent):
    the live database holds every row on the operator's clock, in event and state tables."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(gather, "_SCANNED", set())
    local = LocalSession(tmp_path / "ns" / "job")
    offsets = {"a": 0, "b": 3_000_000_000}
    for node, t in (("a", 10_000_000_000), ("b", 13_000_000_000)):
        _node(local, node, [t, t + 100_000_000])
        w = SegmentWriter(local.node_dir(node), node, "s")
        w.append("nccl_events", {"timestamp_ns": [t + 200_000_000], "pod": [f"{node}-0"], "seq": [2], "pid": [1]})
        w.put_rows("nccl_inflight", [{"pid": 1, "tid": 1, "seen_ns": t + 300_000_000, "since_ns": t,
                                      "state": "S", "op": "ALL_REDUCE"}])
        w.flush()
    for f in local.files("b", "nccl_events"):
        pq.write_table(pq.read_table(f).drop_columns(["pod", "stream"]), f)
    ingest_and_analyse(local, offsets)
    con = duckdb.connect(str(local.live_db), read_only=True)
    try:
        calls = con.execute("SELECT node, seq, timestamp_ns, pod FROM nccl_events ORDER BY node, seq").fetchall()
        tcp = con.execute("SELECT node, timestamp_ns FROM tcp_events ORDER BY node").fetchall()
        inflight = con.execute("SELECT node, seen_ns, since_ns FROM nccl_inflight ORDER BY node").fetchall()
        extent = con.execute("SELECT node, calls, first_ns, last_ns FROM _extent ORDER BY node").fetchall()
    finally:
        con.close()
    assert calls == [("a", 0, 10_000_000_000, None), ("a", 1, 10_100_000_000, None), ("a", 2, 10_200_000_000, "a-0"),
                     ("b", 0, 10_000_000_000, None), ("b", 1, 10_100_000_000, None), ("b", 2, 10_200_000_000, None)]
    assert tcp == [("a", 10_000_000_000), ("b", 10_000_000_000)]
    assert inflight == [("a", 10_300_000_000, 10_000_000_000), ("b", 10_300_000_000, 10_000_000_000)]
    assert extent == [("a", 3, 10_000_000_000, 10_200_000_000), ("b", 3, 10_000_000_000, 10_200_000_000)]
    # the rows from a time on are those from then on on the operator's clock, whatever the node's
    con = duckdb.connect()
    schema.create_all(con)
    gather._insert(con, "nccl_events", gather._sources(local, "nccl_events", offsets), since=10_100_000_000)
    assert con.execute("SELECT node, timestamp_ns FROM nccl_events ORDER BY ALL").fetchall() == \
        [(n, t) for n in "ab" for t in (10_100_000_000, 10_200_000_000)]


def _calls(local: LocalSession) -> tuple[int, int]:
    con = duckdb.connect(str(local.live_db), read_only=True)
    try:
        return (con.execute("SELECT count(*) FROM nccl_events").fetchone()[0],
                con.execute("SELECT count(*) FROM _ingested WHERE tbl = 'nccl_events'").fetchone()[0])
    finally:
        con.close()


def test_live_ingest_adds_each_announced_segment_once_and_scans_the_folder_once(tmp_path, monkeypatch):
    monkeypatch.setattr(gather, "_SCANNED", set())
    local = LocalSession(tmp_path / "ns" / "job")
    _node(local, "a", [1_000, 2_000])
    ingest_and_analyse(local, {"a": 0})       # the first refresh: every segment in the folder
    ingest_and_analyse(local, {"a": 0})       # nothing new: nothing added twice
    assert _calls(local) == (2, 1)
    before = set(local.files("a", "nccl_events"))
    _node(local, "a", [3_000])                # a new segment, not announced: not listed again
    ingest_and_analyse(local, {"a": 0})
    assert _calls(local) == (2, 1)
    (new,) = set(local.files("a", "nccl_events")) - before
    local.announce("a", "nccl_events", new.name)     # as the gather does after each download
    local.announce("a", "nccl_events", new.name)
    ingest_and_analyse(local, {"a": 0})
    assert _calls(local) == (3, 2)
    assert not local.announced.exists()
    _node(local, "a", [4_000])
    gather._SCANNED.clear()                   # a restarted operator lists the folder once
    ingest_and_analyse(local, {"a": 0})
    assert _calls(local) == (4, 3)


def test_a_fault_starting_mid_session_is_named_from_the_recent_window(tmp_path):
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "job")
    # 400 steps of 50 ms (20 s); rank 3 works 4 ms longer before each collective from step 300
    # on (the last 5 s): 8 ms/step then, 2 ms/step (4%) over the whole session, under the floor.
    lay = session(local.work / "nodes", steps=400, fault="slow-rank", fault_from_step=300, late_ms=4.0)
    whole, _ = ingest_and_analyse(local, {})
    assert whole.verdict == "none" and whole.best_candidate == "rank 3"   # 3/4 of it was healthy
    live, _ = ingest_and_analyse(local, {}, recent_s=6.0)
    assert live.straggler is not None and live.straggler.rank == lay["victim"]
    assert re.match(r"in the last 6(\.\d+)? s: ", live.straggler.evidence), live.straggler.evidence
    assert live.warnings[0].startswith("live figures cover the last 6 s of 3,200 NCCL calls")
    # a session not much longer than the window is judged whole only
    short = LocalSession(tmp_path / "ns" / "short")
    session(short.work / "nodes", steps=110, fault="slow-rank", fault_from_step=85, late_ms=4.0)   # 5.5 s
    assert ingest_and_analyse(short, {}, recent_s=6.0)[0].verdict == "none"


def test_a_clean_session_names_nobody_in_its_recent_window_either(tmp_path):
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "job")
    session(local.work / "nodes", steps=400, fault="clean")
    assert ingest_and_analyse(local, {}, recent_s=6.0)[0].verdict == "none"


def test_the_recent_window_stretches_to_forty_steps_for_long_steps(tmp_path):
    from bench.synthetic import session

    # 60 steps of 150 ms; asked for a 2 s window, which is fewer than 40 steps: 6 s it is.
    # The last 15 steps (2.25 s) late: a 2 s window would hold only late steps, but the
    # last 40 hold 25 healthy ones, too few late to name anyone yet.
    local = LocalSession(tmp_path / "ns" / "job")
    session(local.work / "nodes", steps=60, step_ms=150.0, fault="slow-rank", fault_from_step=45)
    assert ingest_and_analyse(local, {}, recent_s=2.0)[0].verdict == "none"
    # the last 30 late: most of the last 40 steps are, and the window names the rank
    more = LocalSession(tmp_path / "ns" / "more")
    lay = session(more.work / "nodes", steps=60, step_ms=150.0, fault="slow-rank", fault_from_step=30)
    live = ingest_and_analyse(more, {}, recent_s=2.0)[0]
    assert live.straggler is not None and live.straggler.rank == lay["victim"]
    assert re.match(r"in the last 6(\.\d+)? s: ", live.straggler.evidence), live.straggler.evidence


def test_the_recent_window_counts_off_cpu_time_since_its_start(tmp_path):
    from bench.synthetic import session
    from ingero_operator.gather import _analyse_recent

    local = LocalSession(tmp_path / "ns" / "job")
    lay = session(local.work / "nodes", steps=400, fault="cpu-hog", fault_from_step=300)
    whole, _ = ingest_and_analyse(local, {})       # keeps a snapshot of the kernel's totals
    con = duckdb.connect(str(local.live_db))
    try:
        last = con.execute("SELECT max(timestamp_ns) FROM nccl_events").fetchone()[0]
        since = last - 6_000_000_000
        # pretend a refresh just before the window saw a quarter of today's totals,
        # and an older one saw none (dropped once a newer one is at or before the start)
        con.execute("INSERT INTO _sched_totals_at SELECT ?, * REPLACE (total_ns // 4 AS total_ns) "
                    "FROM sched_totals", [since - 1])
        con.execute("INSERT INTO _sched_totals_at SELECT ?, * REPLACE (0 AS total_ns) FROM sched_totals",
                    [since - 2_000_000_000])
        first = con.execute("SELECT min(timestamp_ns) FROM nccl_events").fetchone()[0]
        recent = _analyse_recent(con, None, 6.0, last - first)
        assert con.execute("SELECT min(at_ns) FROM _sched_totals_at").fetchone()[0] == since - 1
    finally:
        con.close()
    for w, r in zip(whole.ranks, recent.ranks):
        assert r.offcpu_ms["runqueue"] == pytest.approx(w.offcpu_ms["runqueue"] * 0.75, rel=1e-3)
    assert recent.straggler.rank == lay["victim"] and recent.straggler.cause == "cpu-contention"


def test_the_live_status_names_nobody_before_forty_steps(tmp_path):
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "job")
    session(local.work / "nodes", steps=30, fault="slow-rank")
    early = ingest_and_analyse(local, {}, recent_s=6.0)[0]
    # not an all-clear: too few steps to judge yet
    assert early.verdict == "cannot-judge" and early.straggler is None
    assert early.cannot_judge == "29 steps traced so far; the live verdict waits for 40"   # 30 calls: 29 gaps
    more = LocalSession(tmp_path / "ns" / "more")
    lay = session(more.work / "nodes", steps=45, fault="slow-rank")
    assert ingest_and_analyse(more, {}, recent_s=6.0)[0].straggler.rank == lay["victim"]


def test_a_live_session_is_judged_on_its_recent_window_only_once_per_refresh(tmp_path, monkeypatch):
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "job")
    lay = session(local.work / "nodes", steps=400, fault="slow-rank", fault_from_step=300)
    judged = []
    monkeypatch.setattr(gather, "analyse_part", lambda *a, **k: judged.append(1) or analyse_part(*a, **k))
    live, world = ingest_and_analyse(local, {}, recent_s=6.0)
    assert judged == [1] and world == 4 and live.straggler.rank == lay["victim"]
    calls = 400 * 2 * 4                    # 400 steps x 2 ops x 4 ranks (the table ends at the slower node)
    assert live.warnings[0].startswith(f"live figures cover the last 6 s of {calls:,} NCCL calls")
    # the table covers the window: 6 s of the late steps (2 ops per step)
    expect = 2 * 6000 / live.mean_step_ms
    assert all(abs(r.collectives - expect) <= 6 for r in live.ranks), ([r.collectives for r in live.ranks], expect)
    # the next refresh knows the step: one analysis again, and the same figures
    again, _ = ingest_and_analyse(local, {}, recent_s=6.0)
    assert judged == [1, 1] and again.straggler.rank == lay["victim"]
    assert [r.collectives for r in again.ranks] == [r.collectives for r in live.ranks]


def _live_span_s(local: LocalSession) -> float:
    con = duckdb.connect(str(local.live_db), read_only=True)
    try:
        lo, hi = con.execute("SELECT min(timestamp_ns), max(timestamp_ns) FROM nccl_events").fetchone()
        return (hi - lo) / 1e9
    finally:
        con.close()


def test_the_live_database_keeps_two_windows_of_events_and_a_call_in_flight(tmp_path):
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "job")
    session(local.work / "nodes", steps=400, fault="clean")              # 20 s
    ingest_and_analyse(local, {}, recent_s=3.0)      # the first refresh learns the step: nothing dropped
    assert _live_span_s(local) > 19.0
    ingest_and_analyse(local, {}, recent_s=3.0)
    assert 5.9 < _live_span_s(local) <= 6.0          # 2 windows of 3 s
    assert _calls(local)[0] < 400 * 2 * 4 * 0.35
    # a thread last seen inside a call it entered 10 s before the newest one (the call has
    # returned since; the snapshot is older): the rows from its entry on stay, so the hang
    # search still pairs the two, and no hang is named
    more = LocalSession(tmp_path / "ns" / "more")
    session(more.work / "nodes", steps=400, fault="clean")
    ingest_and_analyse(more, {}, recent_s=3.0)
    con = duckdb.connect(str(more.live_db))
    last = con.execute("SELECT max(timestamp_ns) FROM nccl_events").fetchone()[0]
    node, pid, tid, op, comm, seq, since = con.execute(
        "SELECT node, pid, tid, op, comm_id_hash, seq, timestamp_ns FROM nccl_events WHERE timestamp_ns <= ? "
        "ORDER BY timestamp_ns DESC LIMIT 1", [last - 10_000_000_000]).fetchone()
    con.close()
    w = SegmentWriter(more.node_dir(node), node, "s")
    w.put_rows("nccl_inflight", [{"pid": pid, "tid": tid, "seen_ns": last, "state": "S", "op": op,
                                  "comm_id_hash": comm, "seq": seq, "comm_rank": 0, "since_ns": since}])
    w.close()
    rep, _ = ingest_and_analyse(more, {}, recent_s=3.0)
    assert rep.verdict == "none" and 10.0 <= _live_span_s(more) < 10.1, (rep.hang, _live_span_s(more))


def test_a_session_larger_than_a_window_is_judged_in_windows_of_every_call_and_says_so(tmp_path):
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "big")
    lay = session(local.work / "nodes", steps=400, fault="slow-rank")     # 3,200 calls
    whole, _ = build_artifact(local, {})
    assert not any("windows of whole steps" in w for w in whole.warnings)
    part, _ = build_artifact(local, {}, window_calls=800)
    assert part.warnings[0].startswith("judged in 4 windows of whole steps"), part.warnings
    # every call counted once, every step judged once
    assert [r.collectives for r in part.ranks] == [r.collectives for r in whole.ranks]
    assert part.collectives == whole.collectives == 3200
    steps = int(part.warnings[0].split("(")[1].split()[0].replace(",", ""))
    assert steps == 399, part.warnings[0]          # 400 step markers: 399 whole steps
    assert part.straggler.rank == whole.straggler.rank == lay["victim"]
    assert part.straggler.cause == whole.straggler.cause
    assert part.straggler.saving_ms_per_step == pytest.approx(whole.straggler.saving_ms_per_step, rel=0.1)
    assert part.mean_step_ms == pytest.approx(whole.mean_step_ms, rel=0.02)
    # the artifact itself holds every call
    con = duckdb.connect(str(local.artifact), read_only=True)
    con.execute(f"SET file_search_path = '{local.root.resolve()}'")
    assert con.execute("SELECT count(*) FROM nccl_events").fetchone()[0] == 3200


def test_a_session_that_gathered_no_segment_builds_an_empty_artifact(tmp_path):
    """A session stopped before any tracer wrote a segment has no folder yet; its merge
    once failed on that (MergeFailed: cannot open .trace.duckdb.tmp)."""
    local = LocalSession(tmp_path / "default" / "quick-0123abcd")
    rep, world = build_artifact(local, {})
    assert local.artifact.is_file() and rep.ranks == [] and rep.straggler is None and world is None
    assert rep.verdict == "cannot-judge" and rep.cannot_judge.startswith("no NCCL collective or point-to-point")


def _drop_tail(local: LocalSession, node: str, seconds: float) -> None:
    """Node `node`'s segments as a refresh finds them when its agent flushes later than the
    others': its last `seconds` of calls not there yet."""
    from ingero.store import segment_files

    files = segment_files([local.node_dir(node)], "nccl_events")
    con = duckdb.connect()
    last = con.execute(f"SELECT max(timestamp_ns) FROM read_parquet({[str(f) for f in files]})").fetchone()[0]
    for f in files:
        con.execute(f"COPY (SELECT * FROM read_parquet('{f}') WHERE timestamp_ns <= {last - int(seconds * 1e9)}) "
                    f"TO '{f}.tmp' (FORMAT parquet)")
        f.with_name(f.name + ".tmp").replace(f)


@pytest.mark.parametrize("lag_s", [1.0, 2.0, 4.0])
def test_a_node_whose_newest_segment_lags_makes_nobody_a_straggler_live(tmp_path, lag_s):
    # The calls are judged up to the slowest node's newest one: judged as they were, the
    # ranks of the node whose last calls are missing looked absent and the others slow
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "job")
    lay = session(local.work / "nodes", steps=400, fault="clean")
    _drop_tail(local, lay["nodes"][1], lag_s)
    rep, _ = ingest_and_analyse(local, {}, recent_s=6.0)
    assert rep.verdict == "none", (rep.straggler, rep.cannot_judge)
    assert not any("older than the newest" in w for w in rep.warnings), rep.warnings


def test_a_node_far_behind_is_named_in_the_live_warnings(tmp_path):
    from bench.synthetic import session

    local = LocalSession(tmp_path / "ns" / "job")
    lay = session(local.work / "nodes", steps=400, fault="clean")
    _drop_tail(local, lay["nodes"][0], 8.0)
    rep, _ = ingest_and_analyse(local, {}, recent_s=6.0)
    assert rep.verdict == "none", (rep.straggler, rep.cannot_judge)
    assert any(w.startswith(f"node {lay['nodes'][0]}'s newest call is 8.0 s older") for w in rep.warnings), rep.warnings
