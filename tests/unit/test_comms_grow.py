"""ncclCommGrow: the members of a grown communicator get one identity once the traces
of every node meet (ingero/comms.py), on real DuckDB tables and through a view."""

from __future__ import annotations

import duckdb

from ingero import schema
from ingero.comms import GROW_SALT, _splitmix64, grow_links, resolve_split_ranks, with_grow_ids

P = 0x5EED5EED5EED5EED                 # the shrunk parent
D = _splitmix64(P ^ GROW_SALT ^ 0)     # what existing ranks without the id hash (grow number 0)
L = 0x0123456789ABCDEF                 # the fold of the grow id (coordinator, new ranks)
COLS = "node, pid, comm_id_hash, rank, nranks, parent_hash, color, op"


def _con(coordinator: bool = True):
    con = duckdb.connect()
    schema.create_all(con)
    # global ranks 0..2 existing (0 the coordinator), 3 new; the new rank's parent is 0 (none)
    rows = [("n0", 1, L if coordinator else D, 0, 4, P, 0, "COMM_GROW"),
            ("n0", 2, D, 1, 4, P, 0, "COMM_GROW"),
            ("n1", 3, D, 2, 4, P, 0, "COMM_GROW"),
            ("n1", 4, L, 3, 4, 0, None, "COMM_GROW")]
    con.executemany(f"INSERT INTO comms ({COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.executemany(f"INSERT INTO nccl_events ({COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [r[:5] + (r[5] or None, r[6], r[7]) for r in rows])
    con.executemany("INSERT INTO nccl_events (node, pid, comm_id_hash, rank, nranks, seq, op) "
                    "VALUES (?, ?, ?, ?, 4, 0, 'ALL_REDUCE')", [r[:4] for r in rows])
    return con


def test_the_coordinators_row_gives_every_member_the_grow_ids_identity():
    con = _con()
    assert grow_links(con) == [(D, L, P)]
    resolve_split_ranks(con)
    assert con.execute("SELECT DISTINCT comm_id_hash, parent_hash FROM comms").fetchall() == [(L, P)]
    got = con.execute("SELECT op, pid, comm_id_hash, parent_hash FROM nccl_events ORDER BY op, pid").fetchall()
    assert got == [("ALL_REDUCE", p, L, None) for p in (1, 2, 3, 4)] + [("COMM_GROW", p, L, P) for p in (1, 2, 3, 4)]
    resolve_split_ranks(con)             # again (a merge of merged traces): nothing changes
    assert con.execute("SELECT count(DISTINCT comm_id_hash) FROM nccl_events").fetchone() == (1,)


def test_the_same_through_a_view():
    con = _con()
    con.execute("CREATE VIEW raw AS SELECT * FROM nccl_events")
    view = with_grow_ids("SELECT * FROM raw", grow_links(con))
    got = con.execute(f"SELECT op, pid, comm_id_hash, parent_hash FROM ({view}) ORDER BY op, pid").fetchall()
    assert got == [("ALL_REDUCE", p, L, None) for p in (1, 2, 3, 4)] + [("COMM_GROW", p, L, P) for p in (1, 2, 3, 4)]
    assert with_grow_ids("SELECT 1", []) == "SELECT 1"


def test_without_the_coordinators_row_the_two_sides_keep_their_hashes():
    con = _con(coordinator=False)
    assert grow_links(con) == []
    resolve_split_ranks(con)
    got = con.execute("SELECT pid, comm_id_hash FROM nccl_events WHERE op = 'ALL_REDUCE' ORDER BY pid").fetchall()
    assert got == [(1, D), (2, D), (3, D), (4, L)]
