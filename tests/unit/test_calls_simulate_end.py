"""A group closed by ncclGroupSimulateEnd is closed for the analysis too: the rank's
later calls are blocking points of their own, not members of a group left open."""

from __future__ import annotations

import duckdb

from ingero import schema
from ingero.analysis.calls import events, load


def test_group_simulate_end_closes_the_group():
    con = duckdb.connect()
    schema.create_all(con)
    rows, eid = [], 0
    for g in range(2):
        for t, op, seq in ((0, "GROUP_START", None), (1, "ALL_REDUCE", 0), (2, "GROUP_SIMULATE_END", None),
                           (10, "ALL_REDUCE", 1), (20, "ALL_REDUCE", 2)):
            eid += 1
            h = 0xA if seq is not None else 0
            rows.append((eid, "n", 100 + g, g, g, 2, h, seq, t * 1000 + g, 5, op))
    con.executemany("""INSERT INTO nccl_events (event_id, node, pid, global_rank, rank, nranks, comm_id_hash,
                       seq, timestamp_ns, duration_ns, op, ret) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)""", rows)
    c, _ = load(con)
    ev = events(c)
    # per rank: the two all-reduces on their own (instances of 2 members); the simulated group
    # ran nothing and is no blocking point (test_simulated_group.py)
    assert ev.ranks.tolist() == [0, 1]
    assert [int(((ev.rank == g) & (ev.inst >= 0)).sum()) for g in (0, 1)] == [2, 2]
    assert [int((ev.rank == g).sum()) for g in (0, 1)] == [2, 2]
