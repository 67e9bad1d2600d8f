"""Segment writer and readers: real Parquet files and real DuckDB, no root."""

from __future__ import annotations

import numpy as np
import pytest

from ingero import schema
from ingero.cli import main
from ingero.store import SegmentWriter, build_duckdb
from ingero.readonly_sql import open_source
from bench.published import RETRANSMIT_COUNT, SLOW_COLLECTIVE_JOIN, TOP_SLOW_CALLS



def _nccl(n, t0, rank, dur_ns):
    return {
        "timestamp_ns": t0 + np.arange(n, dtype=np.int64) * 100_000_000,
        "duration_ns": np.full(n, dur_ns, dtype=np.int64),
        "op": ["ALL_REDUCE"] * n,
        "rank": np.full(n, rank, dtype=np.int32),
        "nranks": np.full(n, 4, dtype=np.int32),
        "comm_id_hash": np.full(n, 0xDEADBEEF, dtype=np.uint64),
        "seq": np.arange(n, dtype=np.int64),
        "count": np.full(n, 1024, dtype=np.int64),
        "bytes": np.full(n, 4096, dtype=np.int64),
        "pid": np.full(n, 100 + rank, dtype=np.int32),
    }


def test_writer_rolls_segments_that_queries_and_build_duckdb_read_back(tmp_path):
    seg = tmp_path / "seg"
    w = SegmentWriter(seg, node="node-a", session_id="s1")
    w.append("nccl_events", _nccl(10, 1_000_000_000, rank=0, dur_ns=80_000_000))
    w.flush()
    w.append("nccl_events", _nccl(5, 5_000_000_000, rank=1, dur_ns=10_000_000))
    w.append("tcp_events", {"timestamp_ns": [1_000_000_000 + 10_000_000], "event": ["tcp_retransmit_skb"],
                            "rank": [0], "saddr": ["10.0.0.1"], "daddr": ["10.0.0.2"]})
    w.put_rows("nodes", [{"node": "node-a", "lost_nccl": 0, "mono_to_wall_ns": 123}])
    w.close()
    files = sorted(p.name for p in (seg / "nccl_events").glob("*.parquet"))
    assert files == ["node-a__s1__000000.parquet", "node-a__s1__000001.parquet"]

    con = open_source(seg)
    assert con.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 15
    ids = [r[0] for r in con.execute("SELECT event_id FROM nccl_events ORDER BY event_id").fetchall()]
    assert len(set(ids)) == 15
    assert all(i >> 48 == schema.node_prefix("node-a") >> 48 for i in ids)
    rows = con.execute(SLOW_COLLECTIVE_JOIN).fetchall()
    assert [r[0] for r in rows] == [0] * 10  # only rank 0's 80 ms calls are slow
    assert sorted(r[2] for r in rows) == [0] * 9 + [1]  # one retransmit inside the first call
    assert con.execute("SELECT COUNT(*) FROM sched_events").fetchone()[0] == 0  # empty, but exists

    db = build_duckdb([seg, seg], tmp_path / "t.duckdb")  # the same dir twice counts once
    con = open_source(db)
    assert con.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 15
    assert con.execute("SELECT mono_to_wall_ns FROM nodes").fetchall() == [(123,)]


def test_writer_resumes_event_ids_and_segment_numbers_after_restart(tmp_path):
    w = SegmentWriter(tmp_path, node="n", session_id="s")
    w.append("nccl_events", _nccl(3, 0, 0, 1))
    w.close()
    w2 = SegmentWriter(tmp_path, node="n", session_id="s")
    w2.append("nccl_events", _nccl(3, 0, 0, 1))
    w2.close()
    con = open_source(tmp_path)
    assert con.execute("SELECT COUNT(DISTINCT event_id) FROM nccl_events").fetchone()[0] == 6
    assert len(list((tmp_path / "nccl_events").glob("*.parquet"))) == 2


def test_writer_rejects_unknown_columns(tmp_path):
    w = SegmentWriter(tmp_path, node="n", session_id="s")
    with pytest.raises(ValueError, match="unknown columns"):
        w.append("nccl_events", {"bogus": [1]})


def test_query_cli_prints_published_queries_and_one_line_errors(tmp_path, capsys):
    w = SegmentWriter(tmp_path / "seg", node="n", session_id="s")
    w.append("nccl_events", _nccl(3, 0, 2, 60_000_000))
    w.close()
    db = build_duckdb([tmp_path / "seg"], tmp_path / "t.duckdb")
    assert main(["query", str(db), TOP_SLOW_CALLS]) == 0
    out = capsys.readouterr().out
    assert "ALL_REDUCE" in out and "60.000" in out
    assert main(["query", str(db), RETRANSMIT_COUNT]) == 0
    capsys.readouterr()
    assert main(["query", str(db), "SELEC nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ingero: query failed:") and err.count("\n") == 1
    assert main(["query", str(tmp_path / "missing.duckdb"), "SELECT 1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["query", str(tmp_path), "SELECT 1"]) == 0  # tmp_path holds seg/ below it


def test_dict_column_maps_gaps_and_unknown_codes_to_null_and_writes_parquet(tmp_path):
    from ingero.store import dict_column

    col = dict_column(np.array([1, 0, 5, -1, 3]), {1: "ALL_REDUCE", 3: "SEND"})
    assert col.to_pylist() == ["ALL_REDUCE", None, None, None, "SEND"]
    w = SegmentWriter(tmp_path, node="n", session_id="s")
    w.append("nccl_events", {"op": col, "timestamp_ns": np.arange(5), "pid": np.ones(5, np.int32)})
    w.close()
    con = open_source(tmp_path)
    assert con.execute("SELECT op FROM nccl_events ORDER BY timestamp_ns").fetchall() == [
        ("ALL_REDUCE",), (None,), (None,), (None,), ("SEND",)]


def test_a_subcommand_with_a_missing_dependency_fails_alone_with_the_fix(monkeypatch, capsys):
    import sys

    from ingero import cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", "ingero_test_absent_module_xyz")
    monkeypatch.setitem(sys.modules, "ingero_test_absent_module_xyz", None)  # import raises
    args = cli.build_parser().parse_args(["query", "x.duckdb", "SELECT 1"])  # others still parse
    assert args.command == "query" and args.sql == "SELECT 1"
    assert cli.main(["broken"]) == 2
    assert "is not part of this installation" in capsys.readouterr().err


def test_durations_are_delta_packed_and_read_back_exactly(tmp_path):
    """duration_ns (nearly all distinct) is stored delta-packed without a dictionary (an
    encoding every DuckDB since 0.9 reads); DuckDB and pyarrow read every value back,
    negative, beyond 32 bits and the extremes included (deltas wrap around)."""
    import duckdb
    import pyarrow.parquet as pq

    seg = tmp_path / "seg"
    w = SegmentWriter(seg, node="node-a", session_id="s1")
    cols = _nccl(6, 1_000_000_000, rank=0, dur_ns=0)
    cols["duration_ns"] = np.array([5, 1 << 40, -3, -2**63, 2**63 - 1, 123_456_789], dtype=np.int64)
    w.append("nccl_events", cols)
    w.append("sched_events", {"timestamp_ns": [1, 2], "duration_ns": [4_000_000, 9]})
    w.close()
    for table, want in (("nccl_events", cols["duration_ns"].tolist()), ("sched_events", [4_000_000, 9])):
        (f,) = (seg / table).glob("*.parquet")
        md = pq.ParquetFile(f).metadata
        col = md.row_group(0).column(md.schema.names.index("duration_ns"))
        assert "DELTA_BINARY_PACKED" in col.encodings and "RLE_DICTIONARY" not in col.encodings
        assert [d for (d,) in duckdb.sql(f"SELECT duration_ns FROM '{f}'").fetchall()] == want
        assert pq.read_table(f, columns=["duration_ns"]).column(0).to_pylist() == want
