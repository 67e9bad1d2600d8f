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
