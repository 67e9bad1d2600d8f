"""Calls in a group closed by ncclGroupSimulateEnd never ran: NCCL only estimated their
time (src/group.cc: groupLaunch skips doLaunches when given simInfo). The analysis leaves
them out of every judgement, once, where it loads the calls (ingero/analysis/calls.py),
and says how many it left out.

The trace is bench/synthetic.py's slow-rank session, merged as the operator merges it;
the simulated groups are added the way the agent records them: GROUP_START, the
collective, GROUP_SIMULATE_END (ret 0), and the rank's later calls on that communicator
numbered one further (the agent's seq counts every call, bpf/nccl.c).
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import jsonschema
import pytest

from bench.synthetic import session
from ingero import perfetto, schema
from ingero.analysis import analyse
from ingero.analysis.calls import load
from ingero_operator import gather

SCHEMA = json.loads((Path(__file__).with_name("chrome_trace_event.schema.json")).read_text())
AR_COMM = 0x1111_2222_3333_4444          # bench/synthetic.py's ALL_REDUCE communicator


def _merged(tmp_path, steps: int = 60):
    local = gather.LocalSession(tmp_path)
    lay = session(local.work / "nodes", fault="slow-rank", nodes=2, ranks_per_node=2, steps=steps)
    con = duckdb.connect()
    schema.create_all(con)
    for table in schema.EVENT_TABLES:
        gather._insert(con, table, gather._sources(local, table, {}))
    gather._load_state(con, local, {})
    return con, lay


def _simulate(con, rank: int, step: int, before_ns: int, ret: int = 0) -> None:
    """`rank` simulates a group holding one ALL_REDUCE `before_ns` before its step-`step` ALL_REDUCE."""
    node, pid, world, t = con.execute(
        "SELECT node, pid, nranks, timestamp_ns FROM nccl_events WHERE global_rank = ? AND comm_id_hash = ? "
        "AND op = 'ALL_REDUCE' AND seq = ?", [rank, AR_COMM, step]).fetchone()
    # the agent numbered the simulated call `step`, so every later call on the communicator one further
    con.execute("UPDATE nccl_events SET seq = seq + 1 WHERE global_rank = ? AND comm_id_hash = ? AND seq >= ?",
                [rank, AR_COMM, step])
    eid = con.execute("SELECT max(event_id) FROM nccl_events").fetchone()[0]
    t0 = t - before_ns
    rows = [(eid + 1, t0, "GROUP_START", 0, None, 0), (eid + 2, t0 + 1000, "ALL_REDUCE", AR_COMM, step, 0),
            (eid + 3, t0 + 60_000, "GROUP_SIMULATE_END", 0, None, ret)]
    con.executemany("""INSERT INTO nccl_events (event_id, node, pid, tid, global_rank, rank, nranks, timestamp_ns,
                       duration_ns, op, comm_id_hash, seq, ret, count, bytes)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, 50000, ?, ?, ?, ?, 262144, 1048576)""",
                    [(e, node, pid, pid, rank, rank, world, ts, op, h, s, r) for e, ts, op, h, s, r in rows])


def _judged(rep) -> dict:
    d = rep.to_dict()
    d.pop("warnings")
    return d


def test_a_rank_simulating_groups_gets_the_same_report_and_a_note(tmp_path):
    base, lay = _merged(tmp_path / "a")
    con, _ = _merged(tmp_path / "b")
    for step in range(10, 20):
        _simulate(con, 1, step, before_ns=2_000_000)
    want, got = analyse(base), analyse(con)
    assert want.straggler is not None and want.straggler.rank == lay["victim"]
    # not a call of the step, not a member of any instance, no shift of the rank's later calls
    assert got.ranks[1].collectives == want.ranks[1].collectives
    assert _judged(got) == _judged(want)
    note = [w for w in got.warnings if "ncclGroupSimulateEnd" in w]
    assert note == ["10 calls in groups closed by ncclGroupSimulateEnd were left out (NCCL only estimated "
                    "their time and launched nothing): rank 1: 10"]
    assert got.warnings == want.warnings + note
    assert load(con)[0].simulated == {1: 10}


def test_a_simulated_all_reduce_arriving_late_is_no_lateness(tmp_path):
    base, lay = _merged(tmp_path / "a")
    con, _ = _merged(tmp_path / "b")
    # every rank simulates the same group each step; rank 0 comes to it 20 ms after the others
    for step in range(1, 60):
        for r in range(4):
            _simulate(con, r, step, before_ns=2_000_000 if r == 0 else 22_000_000)
    want, got = analyse(base), analyse(con)
    assert got.ranks[0].late_ms == want.ranks[0].late_ms
    assert got.ranks[0].per_op == want.ranks[0].per_op
    assert got.collectives == want.collectives
    assert _judged(got) == _judged(want)
    assert got.straggler.rank == lay["victim"]
    assert any(w.startswith("236 calls in groups closed by ncclGroupSimulateEnd were left out") for w in got.warnings)


def _rows(con, rank, calls):
    eid = con.execute("SELECT coalesce(max(event_id), 0) FROM nccl_events").fetchone()[0]
    out = []
    for i, (t, op, seq, ret) in enumerate(calls):
        out.append((eid + i + 1, "n", 100 + rank, rank, rank, 2, 0xA if seq is not None else 0, seq,
                    t * 1000 + rank, 5, op, ret))
    con.executemany("""INSERT INTO nccl_events (event_id, node, pid, global_rank, rank, nranks, comm_id_hash,
                       seq, timestamp_ns, duration_ns, op, ret) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""", out)


def test_only_the_outermost_simulate_end_of_a_blocking_group_leaves_calls_out(tmp_path):
    con = duckdb.connect()
    schema.create_all(con)
    for r in range(2):
        _rows(con, r, [
            # closed at depth 1 by ncclGroupSimulateEnd (returned 0): nothing of it ran, nested group too
            (0, "GROUP_START", None, 0), (1, "GROUP_START", None, 0), (2, "ALL_REDUCE", 0, 0),
            (3, "GROUP_END", None, 0), (4, "ALL_REDUCE", 1, 0), (5, "GROUP_SIMULATE_END", None, 0),
            # ncclGroupSimulateEnd at depth 2 only closes its level (simInfo is not looked at):
            # the outer ncclGroupEnd launches both
            (10, "GROUP_START", None, 0), (11, "GROUP_START", None, 0), (12, "ALL_REDUCE", 2, 0),
            (13, "GROUP_SIMULATE_END", None, 0), (14, "ALL_REDUCE", 3, 0), (15, "GROUP_END", None, 0),
            # a non-blocking group: ncclGroupSimulateEnd launches it (groupLaunchNonBlocking, no
            # simInfo) and returns ncclInProgress
            (20, "GROUP_START", None, 7), (21, "ALL_REDUCE", 4, 7), (22, "GROUP_SIMULATE_END", None, 7),
            # an end whose start was not traced closes nothing, and leaves nothing out
            (30, "ALL_REDUCE", 5, 0), (31, "GROUP_SIMULATE_END", None, 0), (32, "ALL_REDUCE", 6, 0),
        ])
    c, warnings = load(con)
    # the launched calls, numbered over launched calls (NCCL's seqNumber): 5 instances of both ranks
    assert sorted(c.seq[c.inst >= 0].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert c.inst_size.tolist() == [2] * 5
    assert c.simulated == {0: 2, 1: 2}
    assert warnings == ["4 calls in groups closed by ncclGroupSimulateEnd were left out (NCCL only estimated "
                        "their time and launched nothing): rank 0: 2, rank 1: 2"]


def test_perfetto_draws_simulated_calls_apart_and_keeps_the_instances(tmp_path):
    base, _ = _merged(tmp_path / "a", steps=20)
    con, _ = _merged(tmp_path / "b", steps=20)
    for step in range(5, 10):
        _simulate(con, 1, step, before_ns=2_000_000)
    want, _ = perfetto.build(base)
    doc, summ = perfetto.build(con)
    jsonschema.validate(doc, SCHEMA)
    sim = [e for e in doc["traceEvents"] if e.get("cat") == "simulated"]
    assert len(sim) == 5 and summ.slices["simulated"] == 5
    assert {e["name"] for e in sim} == {"ALL_REDUCE (simulated)"}
    assert all(e["args"]["simulated"] and "late_ms" not in e["args"] for e in sim)
    # the launched calls: the same instances, lateness and arrows as without the simulated groups
    flows = lambda d: sorted((e["ph"], e["ts"], e["args"]["op"]) for e in d["traceEvents"] if e.get("cat") == "flow")
    lates = lambda d: sorted((e["ts"], e["args"].get("late_ms")) for e in d["traceEvents"]
                             if e.get("cat") == "collective")
    assert flows(doc) == flows(want)
    assert lates(doc) == lates(want)


def _rank_detail(con, root, rank: int) -> dict:
    """The MCP server's rank_detail on `con`'s trace, saved under `root`, in process."""
    import anyio

    from ingero.mcp_server import make_server

    root.mkdir()
    con.execute(f"ATTACH '{root / 't.duckdb'}' AS f")
    con.execute("COPY FROM DATABASE memory TO f")
    con.execute("DETACH f")
    res = anyio.run(make_server(root).call_tool, "rank_detail", {"session": "t.duckdb", "rank": rank, "latest": 10})
    assert not res.is_error, res.content[0].text
    return json.loads(res.content[0].text)


def test_the_mcp_latest_collectives_of_a_rank_leave_simulated_calls_out(tmp_path):
    pytest.importorskip("mcp", reason="the MCP SDK is not installed")
    base, _ = _merged(tmp_path / "a")
    con, _ = _merged(tmp_path / "b")
    for step in range(10, 20):
        _simulate(con, 0, step, before_ns=2_000_000)
    want, got = _rank_detail(base, tmp_path / "ra", 0), _rank_detail(con, tmp_path / "rb", 0)
    # rank_detail's `latest`: the same collectives, seq and lateness as without the simulated groups
    assert got["latest"] == want["latest"]
    assert got == {**want, "session": got["session"]}
