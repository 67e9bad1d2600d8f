"""Perfetto export: valid against the format's schema, round-trips to the database's counts, nests, links."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import duckdb
import jsonschema
import pytest

from ingero.cli import main
from ingero.merge import merge
from ingero.perfetto import build, write
from ingero.store import SegmentWriter
from tests.unit.trace_fixture import T0, write_job

SCHEMA = json.loads((Path(__file__).with_name("chrome_trace_event.schema.json")).read_text())
STEPS = 20


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pf")
    write_job(d / "seg", steps=STEPS)
    # a second thread of rank 0 off-CPU across the end of one of rank 0's collectives
    w = SegmentWriter(d / "seg" / "node-a", "node-a", "default.job.abc")
    w.append("sched_events", {"timestamp_ns": [T0 + 26_000_000], "duration_ns": [2_000_000], "reason": ["io"],
                              "pid": [1000], "tid": [1077], "rank": [0], "runq_ns": [0]})
    w.close()
    merge([d / "seg"], d / "job.duckdb")
    return d / "job.duckdb"


def export(path: Path, out: Path, *args: str) -> dict:
    assert main(["export", "perfetto", str(path), "-o", str(out), *args]) == 0
    return json.loads(out.read_text())


def q(path, sql, params=()):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def tracks(doc) -> tuple[dict, dict]:
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    return procs, threads


def test_the_export_is_valid_against_a_schema_of_the_trace_event_format(trace, tmp_path):
    doc = export(trace, tmp_path / "t.json")
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(doc, SCHEMA)
    assert {e["ph"] for e in doc["traceEvents"]} == {"M", "X", "i", "s", "f"}


def test_every_call_retransmit_and_off_cpu_interval_round_trips_to_the_database_counts(trace, tmp_path):
    doc = export(trace, tmp_path / "t.json")
    procs, threads = tracks(doc)
    per_rank = Counter((procs[e["pid"]], e["args"]["rank"]) for e in doc["traceEvents"]
                       if e["ph"] == "X" and e["cat"] == "collective")
    want = {(n, r): c for n, r, c in q(trace, """SELECT node, global_rank, count(*) FROM nccl_events
        WHERE op IN ('ALL_REDUCE', 'ALL_GATHER') GROUP BY ALL""")}
    assert per_rank == want and len(want) == 4
    kinds = Counter(e.get("cat") for e in doc["traceEvents"] if e["ph"] in "Xi")
    assert kinds["offcpu"] == q(trace, "SELECT count(*) FROM sched_events")[0][0]
    assert kinds["p2p"] == q(trace, "SELECT count(*) FROM nccl_events WHERE op IN ('SEND', 'RECV')")[0][0]
    assert kinds["tcp"] == q(trace, "SELECT count(*) FROM tcp_events")[0][0]
    inst = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert sum(e["s"] == "p" for e in inst) == 1          # the retransmit nobody owns sits on its node
    assert all(threads[(e["pid"], e["tid"])].startswith("rank 3") for e in inst if e["s"] == "t")


def test_one_process_per_node_and_thread_tracks_in_rank_order_stable_between_runs(trace, tmp_path):
    a = export(trace, tmp_path / "a.json")
    export(trace, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    procs, threads = tracks(a)
    assert procs == {1: "node-a", 2: "node-b"}
    sort = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in a["traceEvents"]
            if e.get("name") == "thread_sort_index"}
    order = [threads[k] for k in sorted(threads, key=lambda k: (k[0], sort[k]))]
    assert [o.split(" · ")[0] for o in order] == ["rank 0", "rank 0", "rank 1", "rank 2", "rank 3"]
    assert order[0] == "rank 0 · job-rank-0" and order[1] == "rank 0 · overlap 1"


def test_slices_on_every_track_nest_and_the_partial_overlap_moved_to_an_overlap_track(trace, tmp_path):
    doc = export(trace, tmp_path / "t.json")
    procs, threads = tracks(doc)
    by_track = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for key, spans in by_track.items():
        stack = []
        for s, t in sorted(spans, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or t <= stack[-1] + 1e-6, (threads[key], s, t, stack[-1])
            stack.append(t)
    overlap = [k for k, n in threads.items() if "overlap" in n]
    assert len(overlap) == 1 and len(by_track[overlap[0]]) == 1


def test_flow_arrows_link_each_rank_of_a_collective_to_the_rank_that_arrived_last(trace, tmp_path):
    doc = export(trace, tmp_path / "t.json")
    procs, threads = tracks(doc)
    starts = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "f"}
    instances = q(trace, "SELECT count(*) - 1 FROM nccl_events WHERE op IN ('ALL_REDUCE', 'ALL_GATHER') "
                         "GROUP BY comm_id_hash, seq, op")
    assert set(starts) == set(ends) and len(starts) == sum(n for (n,) in instances) == 2 * STEPS * 3
    slices = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "collective":
            slices[(e["pid"], e["tid"])].append(e)

    def bound(ev):   # the collective slice the flow event sits in, on its own track
        hits = [x for x in slices[(ev["pid"], ev["tid"])] if x["ts"] <= ev["ts"] <= x["ts"] + x["dur"]]
        assert len(hits) == 1, ev
        return hits[0]

    for fid, s in starts.items():
        a, b = bound(s), bound(ends[fid])
        assert (a["args"]["seq"], a["name"], a["args"]["comm"]) == (b["args"]["seq"], b["name"], b["args"]["comm"])
        assert a["ts"] <= b["ts"]
        if b["name"] == "ALL_REDUCE":
            assert threads[(ends[fid]["pid"], ends[fid]["tid"])].startswith("rank 3")   # the late rank
            assert b["args"]["late_ms"] == pytest.approx(6.0, abs=0.01)


def test_a_time_window_keeps_only_events_inside_it(trace, tmp_path):
    full = export(trace, tmp_path / "full.json")
    doc = export(trace, tmp_path / "w.json", "--start", "100ms", "--end", "200ms")
    xs = [e for e in doc["traceEvents"] if e["ph"] in "Xi"]
    assert xs and all(100_000 <= e["ts"] < 200_000 for e in xs)
    assert len(xs) < len([e for e in full["traceEvents"] if e["ph"] in "Xi"]) / 5
    jsonschema.validate(doc, SCHEMA)


def test_sampling_keeps_whole_collectives_so_every_arrow_still_has_both_ends(trace, tmp_path):
    full = export(trace, tmp_path / "full.json")
    doc = export(trace, tmp_path / "s.json", "--max-events", "400")
    n = sum(e["ph"] != "M" for e in doc["traceEvents"])
    assert n <= 400 and n < 0.6 * sum(e["ph"] != "M" for e in full["traceEvents"])
    per_instance = Counter((e["args"]["comm"], e["args"]["seq"], e["name"]) for e in doc["traceEvents"]
                           if e["ph"] == "X" and e["cat"] == "collective")
    assert per_instance and set(per_instance.values()) == {4}
    ids = Counter(e["id"] for e in doc["traceEvents"] if e["ph"] in "sf")
    assert set(ids.values()) == {2} and len(ids) == 3 * len(per_instance)
    assert doc["otherData"]["sampled_stride"] != "1"


def test_bad_options_and_an_empty_trace_fail_with_one_line(trace, tmp_path, capsys):
    assert main(["export", "perfetto", str(trace), "-o", str(tmp_path / "x.json"), "--start", "2s",
                 "--end", "1s"]) == 2
    assert main(["export", "perfetto", str(trace), "-o", str(tmp_path / "no" / "x.json")]) == 2
    empty = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(empty))
    from ingero.schema import create_all
    create_all(con)
    con.close()
    assert main(["export", "perfetto", str(empty), "-o", str(tmp_path / "x.json")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and "--end" in lines[0] and "does not exist" in lines[1] and "no NCCL" in lines[2]


def test_build_and_write_give_the_same_document(trace, tmp_path):
    con = duckdb.connect(str(trace), read_only=True)
    doc, summ = build(con)
    con.close()
    write(doc, tmp_path / "d.json")
    assert json.loads((tmp_path / "d.json").read_text()) == doc
    assert summ.flows == 2 * STEPS * 3 and summ.nodes == 2 and summ.overlap_tracks == 1
