"""The artifact's event tables as views over the node segments (ingero.segment_views)."""

from __future__ import annotations

import pyarrow.parquet as pq

from ingero import schema
from ingero.readonly_sql import open_source
from ingero.segment_views import SegmentViews
from ingero.store import SegmentWriter
from ingero_operator.gather import LocalSession, build_artifact

S = 1_000_000_000


def _node(local: LocalSession, node: str, segments: list[list[int]], drop: tuple[str, ...] = ()) -> None:
    """One segment of nccl_events per list of timestamps; `drop`: columns its files lack."""
    w = SegmentWriter(local.node_dir(node), node, "s")
    for ts in segments:
        n = len(ts)
        w.append("nccl_events", {"timestamp_ns": ts, "duration_ns": [1] * n, "op": ["ALL_REDUCE"] * n,
                                 "comm_id_hash": [7] * n, "seq": list(range(n)), "pid": [1] * n, "pod": [f"{node}-0"] * n,
                                 "global_rank": [0 if node == "a" else 1] * n, "ret": [0] * n})
        w.flush()
    w.put_rows("nodes", [{"lost_nccl": 0}])
    w.flush()
    for f in local.files(node, "nccl_events"):
        pq.write_table(pq.read_table(f).drop_columns(list(drop)), f)


def test_each_file_is_shifted_by_its_nodes_offset_and_columns_it_lacks_read_as_null(tmp_path):
    """Node b's clock runs 3 s ahead and its agent writes no `pod`; no node writes `stream`."""
    local = LocalSession(tmp_path / "job")
    _node(local, "a", [[10 * S, 11 * S]], drop=("stream",))
    _node(local, "b", [[13 * S, 14 * S]], drop=("stream", "pod"))
    build_artifact(local, {"a": 0, "b": 3 * S})
    con = open_source(local.artifact)
    try:
        got = con.execute("SELECT node, timestamp_ns, pod, stream FROM nccl_events ORDER BY node, seq").fetchall()
        types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE nccl_events)").fetchall())
        listed = con.execute("SELECT tbl, file, offset_ns, first_ns, last_ns, rows FROM segments").fetchall()
    finally:
        con.close()
    assert got == [("a", 10 * S, "a-0", None), ("a", 11 * S, "a-0", None),
                   ("b", 10 * S, None, None), ("b", 11 * S, None, None)]
    assert types["stream"] == dict(schema.TABLES["nccl_events"].columns)["stream"]
    assert listed == [("nccl_events", f"work/nodes/{n}/nccl_events/{n}__s__000000.parquet", off, 10 * S, 11 * S, 2)
                      for n, off in (("a", 0), ("b", 3 * S))]


def test_a_window_reads_only_the_segments_whose_time_range_meets_it(tmp_path):
    local = LocalSession(tmp_path / "job")
    _node(local, "a", [[10 * S, 11 * S], [20 * S, 21 * S], [30 * S, 31 * S]])
    _node(local, "b", [[12 * S, 13 * S], [22 * S, 23 * S], [32 * S, 33 * S]])     # 2 s ahead
    build_artifact(local, {"a": 0, "b": 2 * S})
    con = open_source(local.artifact)
    try:
        views = SegmentViews.stored(con)
        assert views is not None and views.extent() == (12, 10 * S, 31 * S)
        for lo, hi, files, rows in ((15 * S, 25 * S, ["a/nccl_events/a__s__000001", "b/nccl_events/b__s__000001"],
                                     [("a", 20 * S), ("a", 21 * S), ("b", 20 * S), ("b", 21 * S)]),
                                    (21 * S, None, ["a/nccl_events/a__s__000001", "a/nccl_events/a__s__000002",
                                                    "b/nccl_events/b__s__000001", "b/nccl_events/b__s__000002"],
                                     [("a", 21 * S), ("a", 30 * S), ("a", 31 * S),
                                      ("b", 21 * S), ("b", 30 * S), ("b", 31 * S)])):
            with views.between(con, lo, hi):
                sql = con.execute("SELECT sql FROM duckdb_views() WHERE temporary AND view_name = 'nccl_events'"
                                  ).fetchone()[0]
                got = con.execute("SELECT node, timestamp_ns FROM nccl_events ORDER BY ALL").fetchall()
            read = sorted(p.split("/work/nodes/")[1][:-len(".parquet")] for p in sql.split("'") if p.endswith(".parquet"))
            assert (read, got) == (files, rows)
            assert all(p.startswith(str(local.root.resolve())) for p in sql.split("'") if p.endswith(".parquet"))
        assert con.execute("SELECT count(*) FROM nccl_events").fetchone()[0] == 12     # the whole view is back
    finally:
        con.close()


class _Counting:
    """A connection that counts the queries of `comms` made through it."""

    def __init__(self, con):
        self.con, self.comms = con, 0

    def execute(self, sql, *args):
        self.comms += sql.lstrip().startswith("SELECT") and " comms" in sql
        return self.con.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.con, name)


def test_split_ranks_show_in_the_whole_view_and_in_each_window_from_comms_read_once(tmp_path):
    """Two ranks split one communicator (keys reversed): their calls, recorded with rank -1,
    show the child's ranks; the views read `comms` once, not once per window."""
    local = LocalSession(tmp_path / "job")
    for g, node in enumerate("ab"):
        w = SegmentWriter(local.node_dir(node), node, "s")
        for t in (10 * S, 20 * S):
            w.append("nccl_events", {"timestamp_ns": [t], "duration_ns": [1], "op": ["ALL_REDUCE"], "pid": [1],
                                     "comm_id_hash": [0xB], "rank": [-1], "nranks": [-1], "seq": [t // S]})
            w.flush()
        w.put_rows("comms", [{"pid": 1, "comm_id_hash": 0xA, "rank": g, "nranks": 2, "op": "COMM_INIT_RANK"},
                             {"pid": 1, "comm_id_hash": 0xB, "rank": -1, "nranks": -1, "parent_hash": 0xA,
                              "color": 0, "split_key": 1 - g, "op": "COMM_SPLIT"}])
        w.put_rows("nodes", [{"lost_nccl": 0}])
        w.flush()
    build_artifact(local, {})
    con = open_source(local.artifact)
    try:
        views = SegmentViews.stored(con)
        assert views is not None
        whole = con.execute("SELECT node, seq, rank, nranks FROM nccl_events ORDER BY ALL").fetchall()
        assert whole == [("a", 10, 1, 2), ("a", 20, 1, 2), ("b", 10, 0, 2), ("b", 20, 0, 2)]
        counting, reads = _Counting(con), []
        for lo, hi in ((5 * S, 15 * S), (15 * S, None)):
            with views.between(counting, lo, hi):
                got = con.execute("SELECT node, seq, rank, nranks FROM nccl_events ORDER BY ALL").fetchall()
            assert got == [r for r in whole if lo <= r[1] * S < (hi or 1 << 62)]
            reads.append(counting.comms)
        assert reads[0] > 0 and reads[1] == reads[0]
    finally:
        con.close()
