"""The column-wise analysis (the operator's gather) gives the SQL analysis' report, exactly.

Each case writes segments in the operator's layout, then compares
``gather.build_artifact`` (column-wise, ``ingero.analysis_dense``) with every
row copied into DuckDB and analysed in SQL.
"""

from __future__ import annotations

import logging

import duckdb
import numpy as np
import pytest

from bench.synthetic import scale_session, session
from ingero import schema
from ingero.analysis import analyse
from ingero.comms import resolve_split_ranks
from ingero.store import SegmentWriter
from ingero_operator import gather


def _sql_report(local, offsets, slow=None):
    con = duckdb.connect()
    schema.create_all(con)
    for table in schema.EVENT_TABLES:
        gather._insert(con, table, gather._sources(local, table, offsets))
    gather._load_state(con, local, offsets)
    resolve_split_ranks(con)
    return analyse(con, slow)


def _compare(local, offsets, caplog, slow=None, dense=True):
    with caplog.at_level(logging.INFO, logger="ingero.analysis"):
        caplog.clear()
        got, _ = gather.build_artifact(local, offsets, slow)
    fell_back = "not used" in caplog.text
    assert fell_back != dense, caplog.text
    want = _sql_report(local, offsets, slow)
    assert got.to_dict() == want.to_dict()
    return got


@pytest.mark.parametrize("fault", ["clean", "slow-rank", "io-stall", "cpu-hog", "lossy-link"])
@pytest.mark.parametrize("slow", [None, 5.0])
def test_lab_faults(tmp_path, caplog, fault, slow):
    local = gather.LocalSession(tmp_path)
    session(local.work / "nodes", fault=fault, nodes=3, ranks_per_node=2)
    _compare(local, {}, caplog, slow)


@pytest.mark.parametrize("fault", ["slow-rank", "lossy-link", "clean"])
def test_scale_session_with_clock_offsets(tmp_path, caplog, fault):
    local = gather.LocalSession(tmp_path)
    lay = scale_session(local.work / "nodes", ranks=32, collectives=800, nodes=4, fault=fault,
                        segments_per_node=3)
    rep = _compare(local, lay["offsets"], caplog)
    if fault == "slow-rank":
        assert rep.straggler.rank == lay["victim"]


def _write(local, node, rows: dict, ranks=None, tcp=None, seg=1):
    w = SegmentWriter(local.node_dir(node), node, "s")
    n = len(rows["timestamp_ns"])
    cols = {"ret": [0] * n, "nranks": [4] * n, **rows}
    for lo in range(0, n, max(1, -(-n // seg))):           # several segments per node
        w.append("nccl_events", {k: v[lo:lo + -(-n // seg)] for k, v in cols.items()})
        w.flush()
    if tcp:
        w.append("tcp_events", tcp)
    if ranks is not None:
        w.put_rows("ranks", ranks)
    w.close()


def _calls(pid, grank, comm, seqs, t0, late=0.0, op="ALL_REDUCE", rng=None):
    seqs = list(seqs)
    rng = rng or np.random.default_rng(pid)
    t = [int(t0 + s * 10_000_000 + late * 1e6 + rng.integers(0, 300_000)) for s in seqs]
    return {"timestamp_ns": t, "duration_ns": [int(rng.integers(1_000_000, 3_000_000)) for _ in seqs],
            "op": [op if isinstance(op, str) else op[s % len(op)] for s in seqs],
            "comm_id_hash": [comm] * len(seqs), "seq": seqs, "pid": [pid] * len(seqs),
            "global_rank": [grank] * len(seqs)}


def _cat(*parts):
    return {k: sum((p[k] for p in parts), []) for k in parts[0]}


T0 = 1_750_000_000_000_000_000


def test_missing_calls_extra_rows_and_a_sub_communicator(tmp_path, caplog):
    """Ranks that miss instances or start late, p2p / failed / comm-0 rows to skip, a second
    communicator of two members, the same op on both communicators, unknown processes."""
    local = gather.LocalSession(tmp_path)
    world, sub = 0xAAAA, 0xBBBB
    ops = ("ALL_REDUCE", "ALL_GATHER")
    a = _cat(_calls(10, 0, world, range(0, 60), T0, op=ops),
             _calls(11, 1, world, [s for s in range(60) if s % 7], T0, late=4, op=ops),
             _calls(10, 0, sub, range(0, 30), T0 + 3_000_000))
    p2p = _calls(10, 0, world, range(100, 110), T0, op="SEND")
    failed = _calls(11, 1, world, range(60, 65), T0)
    failed["ret"] = [3] * 5
    zero = _calls(10, 0, 0, range(0, 5), T0)
    a = _cat({**a, "ret": [0] * len(a["seq"])}, {**p2p, "ret": [0] * 10}, failed, {**zero, "ret": [0] * 5})
    _write(local, "node-a", a, ranks=[{"pid": 10, "rank": 0, "pod": "p0"}, {"pid": 11, "rank": 1, "pod": None}],
           seg=3)
    b = _cat(_calls(20, 2, world, range(15, 60), T0, op=ops),      # joined late
             _calls(21, 3, world, range(0, 60), T0, op=ops),       # no ranks row: global_rank decides
             _calls(20, 2, sub, range(0, 30), T0 + 3_000_000, late=2))
    _write(local, "node-b", b, ranks=[{"pid": 20, "rank": 2, "pod": "p2"}], seg=2,
           tcp={"timestamp_ns": [T0 + 5 * 10_000_000 + 1_500_000, T0 + 17 * 10_000_000 + 900_000],
                "event": ["tcp_retransmit_skb"] * 2, "pid": [20, 21], "rank": [2, 3]})
    _compare(local, {"node-b": 1_000_000}, caplog, slow=2.0)


def test_a_rank_restarted_on_another_node(tmp_path, caplog):
    local = gather.LocalSession(tmp_path)
    c = 0xCCCC
    _write(local, "node-a", _cat(_calls(10, 0, c, range(0, 40), T0), _calls(11, 1, c, range(0, 20), T0)),
           ranks=[{"pid": 10, "rank": 0, "pod": "p0"}, {"pid": 11, "rank": 1, "pod": "p1"}])
    _write(local, "node-b", _cat(_calls(30, 1, c, range(20, 40), T0, late=6)),  # rank 1 again, new pid
           ranks=[{"pid": 30, "rank": 1, "pod": "p1b"}])
    rep = _compare(local, {}, caplog)
    r1 = [r for r in rep.ranks if r.rank == 1][0]
    assert (r1.node, r1.pod, r1.pid) == ("node-b", "p1b", 30)     # where it called last


def test_data_the_columns_cannot_hold_falls_back_to_sql(tmp_path, caplog):
    local = gather.LocalSession(tmp_path)
    c = 0xDDDD
    dup = _calls(10, 0, c, [0, 1, 2, 2, 3], T0)                  # seq 2 twice for one rank
    _write(local, "node-a", _cat(dup, _calls(11, 1, c, range(0, 4), T0)),
           ranks=[{"pid": 10, "rank": 0}, {"pid": 11, "rank": 1}])
    _compare(local, {}, caplog, dense=False)


def test_durations_beyond_32_bits_and_retransmits_in_flight(tmp_path, caplog):
    local = gather.LocalSession(tmp_path)
    c = 0xEEEE
    a = _cat(_calls(10, 0, c, range(0, 50), T0), _calls(11, 1, c, range(0, 50), T0))
    a["duration_ns"][7] = 6_000_000_000          # a 6 s call (a hang): durations need 64 bits
    retx = [T0 + s * 10_000_000 + 1_000_000 for s in range(0, 50, 3)]
    _write(local, "node-a", a, ranks=[{"pid": 10, "rank": 0}, {"pid": 11, "rank": 1}],
           tcp={"timestamp_ns": retx, "event": ["tcp_retransmit_skb"] * len(retx),
                "pid": [10] * len(retx), "rank": [0] * len(retx)})
    _write(local, "node-b", _calls(20, 2, c, range(0, 50), T0), ranks=[{"pid": 20, "rank": 2}])
    rep = _compare(local, {}, caplog)
    assert rep.straggler.cause == "network"      # the retransmit windows were compared too


def test_rows_the_sql_filter_drops_with_nulls(tmp_path, caplog):
    """Rows with a NULL or unknown op, NULL communicator or NULL/failed ret are dropped as the
    SQL's WHERE drops them, also when other columns of those rows are NULL; a NULL in a
    kept row's duration is left to the SQL."""
    local = gather.LocalSession(tmp_path)
    c = 0xABAB
    a = _cat(_calls(10, 0, c, range(0, 30), T0), _calls(11, 1, c, range(0, 30), T0, late=5))
    a["ret"] = [0] * len(a["seq"])
    junk = _calls(10, 0, c, range(30, 36), T0)
    junk["op"] = [None, "NOT_AN_OP", "ALL_REDUCE", "ALL_REDUCE", "ALL_REDUCE", "ALL_REDUCE"]
    junk["comm_id_hash"] = [c, c, None, c, c, c]
    junk["ret"] = [0, 0, 0, None, 2, None]
    junk["duration_ns"] = [None, None, None, None, None, 5]
    junk["timestamp_ns"][4] = None
    _write(local, "node-a", _cat(a, junk), ranks=[{"pid": 10, "rank": 0}, {"pid": 11, "rank": 1}], seg=2)
    _write(local, "node-b", {**_calls(20, 2, c, range(0, 30), T0), "ret": [0] * 30},
           ranks=[{"pid": 20, "rank": 2}])
    _compare(local, {"node-b": -2_000_000}, caplog)

    local2 = gather.LocalSession(tmp_path / "kept-null")
    b = {**_calls(10, 0, c, range(0, 10), T0), "ret": [0] * 10}
    b["duration_ns"][3] = None
    _write(local2, "node-a", _cat(b, {**_calls(11, 1, c, range(0, 10), T0), "ret": [0] * 10}),
           ranks=[{"pid": 10, "rank": 0}, {"pid": 11, "rank": 1}])
    with caplog.at_level(logging.INFO, logger="ingero.analysis"):
        caplog.clear()
        got, _ = gather.build_artifact(local2, {})
    assert "NULL duration_ns" in caplog.text
    assert got.to_dict() == _sql_report(local2, {}).to_dict()
