"""Split-communicator ranks resolved across nodes, on real DuckDB tables."""

from __future__ import annotations

import duckdb

from ingero import schema
from ingero.comms import resolve_split_ranks


def _con():
    con = duckdb.connect()
    schema.create_all(con)
    return con


def test_split_children_are_numbered_by_key_then_parent_rank_across_nodes():
    con = _con()
    world = 0xAAAA
    rows = []
    # 4 ranks on 2 nodes; color = node; keys equal, so parent rank decides the order
    for g in range(4):
        node, pid = f"n{g // 2}", 100 + g
        rows.append((node, pid, world, g, 4, None, None, None, "COMM_INIT_RANK"))
        rows.append((node, pid, 0xC0 + g // 2, -1, -1, world, g // 2, 0, "COMM_SPLIT"))
    con.executemany("""INSERT INTO comms (node, pid, comm_id_hash, rank, nranks, parent_hash, color,
                       split_key, op) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""", rows)
    for g in range(4):
        con.execute("""INSERT INTO nccl_events (node, pid, comm_id_hash, rank, nranks, op)
                       VALUES (?, ?, ?, -1, -1, 'REDUCE_SCATTER')""", [f"n{g // 2}", 100 + g, 0xC0 + g // 2])
    assert resolve_split_ranks(con) == 4
    got = con.execute("SELECT pid, rank, nranks FROM nccl_events ORDER BY pid").fetchall()
    assert got == [(100, 0, 2), (101, 1, 2), (102, 0, 2), (103, 1, 2)]


def test_split_key_orders_before_parent_rank_and_nested_splits_resolve():
    con = _con()
    rows = [("n", 1, 0xA, 0, 2, None, None, None, "COMM_INIT_RANK"),
            ("n", 2, 0xA, 1, 2, None, None, None, "COMM_INIT_RANK"),
            # keys reverse the order: parent rank 1 becomes child rank 0
            ("n", 1, 0xB, -1, -1, 0xA, 0, 5, "COMM_SPLIT"),
            ("n", 2, 0xB, -1, -1, 0xA, 0, 1, "COMM_SPLIT"),
            # a split of the split
            ("n", 1, 0xC, -1, -1, 0xB, 0, 0, "COMM_SPLIT"),
            ("n", 2, 0xC, -1, -1, 0xB, 0, 0, "COMM_SPLIT")]
    con.executemany("""INSERT INTO comms (node, pid, comm_id_hash, rank, nranks, parent_hash, color,
                       split_key, op) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""", rows)
    assert resolve_split_ranks(con) == 4
    got = con.execute("""SELECT comm_id_hash, pid, rank FROM comms WHERE op = 'COMM_SPLIT'
                         ORDER BY ALL""").fetchall()
    assert got == [(0xB, 1, 1), (0xB, 2, 0), (0xC, 1, 1), (0xC, 2, 0)]


def test_split_stays_unresolved_when_a_parent_member_was_not_traced():
    con = _con()
    rows = [("n", 1, 0xA, 0, 3, None, None, None, "COMM_INIT_RANK"),
            ("n", 2, 0xA, 1, 3, None, None, None, "COMM_INIT_RANK"),  # rank 2 of 3 not traced
            ("n", 1, 0xB, -1, -1, 0xA, 0, 0, "COMM_SPLIT"),
            ("n", 2, 0xB, -1, -1, 0xA, 0, 0, "COMM_SPLIT")]
    con.executemany("""INSERT INTO comms (node, pid, comm_id_hash, rank, nranks, parent_hash, color,
                       split_key, op) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""", rows)
    assert resolve_split_ranks(con) == 0
    assert con.execute("SELECT DISTINCT rank FROM comms WHERE op = 'COMM_SPLIT'").fetchall() == [(-1,)]
