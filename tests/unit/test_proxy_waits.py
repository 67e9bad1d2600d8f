"""ingero.analysis.proxy and the network verdict's proxy evidence, on built traces."""

from __future__ import annotations

import duckdb

from ingero import schema
from ingero.analysis.model import RankRow
from ingero.analysis.proxy import add_proxy_waits
from ingero.analysis.verdict import _proxy_evidence


def _rows() -> dict:
    return {r: RankRow(rank=r, node="a" if r < 2 else "b", pod=None, pid=100 + r) for r in range(4)}


def test_each_ranks_send_network_wait_is_summed_from_the_proxy_summaries():
    con = duckdb.connect()
    schema.create_all(con)
    for rank, send, recv in ((0, 5, 900), (1, 120, 800), (1, 80, 0), (2, 6, 700), (3, 9, 750)):
        con.execute("INSERT INTO nccl_proxy (rank, send_net_wait_ns, recv_net_wait_ns) VALUES (?, ?, ?)",
                    [rank, send * 1_000_000, recv * 1_000_000])
    rows = _rows()
    add_proxy_waits(con, rows)
    assert {r: v.net_wait_ms for r, v in rows.items()} == {0: 5.0, 1: 200.0, 2: 6.0, 3: 9.0}
    assert _proxy_evidence(rows, "a") == ("; NCCL's proxy: a's ranks' sends waited up to 200 ms on the network, "
                                          "the other ranks' 8 ms at median")


def test_without_proxy_summaries_nothing_is_added():
    rows = _rows()
    add_proxy_waits(duckdb.connect(), rows)         # a trace without the table
    assert all(v.net_wait_ms is None for v in rows.values())
    assert _proxy_evidence(rows, "a") == ""


def test_a_peer_on_another_node_gets_its_global_rank_once_the_traces_are_merged():
    from ingero.comms import resolve_split_ranks

    con = duckdb.connect()
    schema.create_all(con)
    for node, pid, rank, comm_rank in (("a", 100, 0, 0), ("b", 200, 5, 1)):
        con.execute("INSERT INTO nccl_device_inflight (node, pid, rank, comm_hash, comm_rank) VALUES (?, ?, ?, 7, ?)",
                    [node, pid, rank, comm_rank])
    con.execute("INSERT INTO nccl_proxy (node, rank, comm_hash, peer, peer_rank) VALUES "
                "('a', 0, 7, 1, NULL), ('b', 5, 7, 0, 0), ('a', 0, 7, 3, NULL), ('a', 0, 8, 1, NULL)")
    resolve_split_ranks(con)
    got = con.execute("SELECT rank, comm_hash, peer, peer_rank FROM nccl_proxy ORDER BY ALL").fetchall()
    # peer 3 of communicator 7 and communicator 8 were not traced: still unknown
    assert got == [(0, 7, 1, 5), (0, 7, 3, None), (0, 8, 1, None), (5, 7, 0, 0)]
