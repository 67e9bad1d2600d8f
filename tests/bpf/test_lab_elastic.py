"""Acceptance (issue 12): the lab's elastic job (`ingero lab run --elastic`; 2 nodes x 2
ranks) shrinks its world without rank 1 (ncclCommShrink), runs on the shrunk
communicator, grows back to 4 ranks (ncclCommGetUniqueId on rank 0, ncclCommGrow on
every rank: the coordinator with the grow id, the other survivors with NULL, rank 1
as a new rank with the id) and runs on the grown one, each step also closing a group
with ncclGroupSimulateEnd and calling ncclAlltoAll, ncclGather and ncclScatter.
Traced on real eBPF: the shrink and grow calls carry their parent and child
identities, the grown communicator has ONE identity on all its members (the
coordinator's record links the two sides: ingero/comms.py), and the collectives on
both are attributed to them with the right ranks and sizes, with none lost to the
analysis."""

from __future__ import annotations

import pytest

from tests.conftest import bpf_reason

pytestmark = pytest.mark.bpf

ESTEPS = 2                       # checked steps on the shrunk and on the grown communicator each
WORLD, OUT = 4, 1                # worker.c run_elastic leaves out rank 1
COLLS = ("ALL_REDUCE", "ALL_GATHER", "BROADCAST", "ALL_TO_ALL", "GATHER", "SCATTER")
LAUNCHED = 6                     # their calls per elastic step that ran (7 calls: the all-reduce in
                                 # the group ncclGroupSimulateEnd closes runs nothing)
UNGROUPED = 6                    # blocking points per elastic step: the launched calls, each its own


def shrunk_rank(g: int) -> int:
    return g - (g > OUT)


def grown_rank(g: int) -> int:
    return WORLD - 1 if g == OUT else shrunk_rank(g)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    reason = bpf_reason()
    if reason:
        pytest.skip(reason)
    from ingero.lab.runner import LabConfig
    from ingero.lab.tracers import run_traced
    from ingero.readonly_sql import open_source

    out = tmp_path_factory.mktemp("elastic")
    run = run_traced(LabConfig(scenario="clean", nodes=2, ranks_per_node=2, steps=2, compute_ms=10,
                               elastic=True, elastic_steps=ESTEPS, out_dir=out))
    assert set(run.codes.values()) == {0}, f"rank exit codes {run.codes}; logs in {out}"
    assert set(run.stops.values()) == {0}, run.stops_told()
    con = open_source(run.db)
    world = con.execute("SELECT DISTINCT comm_id_hash FROM nccl_events WHERE op = 'COMM_INIT_RANK'").fetchall()
    shrunk = con.execute("SELECT DISTINCT comm_id_hash FROM nccl_events WHERE op = 'COMM_SHRINK'").fetchall()
    grown = con.execute("SELECT DISTINCT comm_id_hash FROM nccl_events WHERE op = 'COMM_GROW'").fetchall()
    assert len(world) == 1 and len(shrunk) == 1, (world, shrunk)
    # one identity for every member of the grown communicator (two: the sides did not meet)
    assert len(grown) == 1, f"the grown communicator has {len(grown)} identities: {grown}"
    yield con, world[0][0], shrunk[0][0], grown[0][0]
    con.close()


def test_shrink_and_grow_are_recorded_with_parent_and_child_identities(elastic):
    con, world, shrunk, grown = elastic
    assert 0 not in (world, shrunk, grown) and len({world, shrunk, grown}) == 3
    rows = con.execute("""SELECT global_rank, rank, nranks, parent_hash, ret FROM nccl_events
                          WHERE op = 'COMM_SHRINK' ORDER BY 1""").fetchall()
    assert rows == [(g, shrunk_rank(g), WORLD - 1, world, 0) for g in range(WORLD) if g != OUT]
    rows = con.execute("""SELECT global_rank, rank, nranks, parent_hash, ret FROM nccl_events
                          WHERE op = 'COMM_GROW' ORDER BY 1""").fetchall()
    # the new rank's row gets the parent once the traces meet, as the existing ranks' have it
    assert rows == [(g, grown_rank(g), WORLD, shrunk, 0) for g in range(WORLD)]
    comms = con.execute("""SELECT op, comm_id_hash, count(DISTINCT pid), min(nranks), max(nranks) FROM comms
                           WHERE op IN ('COMM_SHRINK', 'COMM_GROW') GROUP BY ALL ORDER BY 1""").fetchall()
    assert comms == [("COMM_GROW", grown, WORLD, WORLD, WORLD), ("COMM_SHRINK", shrunk, WORLD - 1, WORLD - 1, WORLD - 1)]


def test_collectives_on_the_shrunk_and_grown_communicators_carry_their_identity(elastic):
    con, _, shrunk, grown = elastic
    for h, members, rank_of, n in ((shrunk, [g for g in range(WORLD) if g != OUT], shrunk_rank, WORLD - 1),
                                   (grown, list(range(WORLD)), grown_rank, WORLD)):
        rows = con.execute(f"""
            SELECT global_rank, rank, nranks, op, count(*), count(DISTINCT seq), any_value(peer)
            FROM nccl_events WHERE comm_id_hash = ? AND op IN {COLLS} GROUP BY ALL ORDER BY 1, 4""",
                             [h]).fetchall()
        # per step one of each, and the simulated group's all-reduce; roots: broadcast and gather 0, scatter n-1
        root = {"BROADCAST": 0, "GATHER": 0, "SCATTER": n - 1}
        want = sorted((g, rank_of(g), n, op, ESTEPS * (2 if op == "ALL_REDUCE" else 1),
                       ESTEPS * (2 if op == "ALL_REDUCE" else 1), root.get(op)) for g in members for op in COLLS)
        assert rows == want, (n, rows)
    sim = con.execute("""SELECT global_rank, count(*) FROM nccl_events WHERE op = 'GROUP_SIMULATE_END'
                         AND ret = 0 GROUP BY 1 ORDER BY 1""").fetchall()
    assert sim == [(g, ESTEPS * (1 if g == OUT else 2)) for g in range(WORLD)]


def test_the_analysis_keeps_every_call_on_the_shrunk_and_grown_communicators(elastic):
    import numpy as np

    from ingero.analysis import analyse
    from ingero.analysis.calls import events, load

    con, _, shrunk, grown = elastic
    c, warnings = load(con)
    # the simulated all-reduce of every elastic step is left out (NCCL launches nothing of a
    # group ncclGroupSimulateEnd closes), and said so: one per member and step, rank 1 (OUT)
    # only on the grown communicator
    sim = {g: ESTEPS * (1 if g == OUT else 2) for g in range(WORLD)}
    said = (f"{sum(sim.values())} calls in groups closed by ncclGroupSimulateEnd were left out "
            "(NCCL only estimated their time and launched nothing): "
            + ", ".join(f"rank {g}: {k}" for g, k in sim.items()))
    assert [w for w in warnings if "left out" in w or "repeat" in w] == [said], warnings
    assert c.simulated == sim
    ev = events(c)
    for h, n in ((shrunk, WORLD - 1), (grown, WORLD)):
        traced = con.execute(f"SELECT count(*) FROM nccl_events WHERE comm_id_hash = ? AND op IN {COLLS}",
                             [h]).fetchone()[0]
        code = int(np.flatnonzero(c.comm_hash == np.uint64(h))[0])
        assert int((c.comm == code).sum()) == traced - n * ESTEPS     # all but the simulated
        assert sorted(c.comm_members[code]) == ([g for g in range(WORLD) if g != OUT] if n < WORLD
                                                else list(range(WORLD)))
        mine = c.inst_comm == code
        assert mine.sum() == LAUNCHED * ESTEPS and (c.inst_size[mine] == n).all(), c.inst_size[mine]
        # the ungrouped collectives are blocking points of their own on every member (a group
        # closed by ncclGroupSimulateEnd is closed: later calls do not sink into it)
        own = ev.inst >= 0
        per_rank = np.bincount(ev.rank[own][c.inst_comm[ev.inst[own]] == code], minlength=WORLD)
        assert sorted(per_rank[per_rank > 0].tolist()) == [UNGROUPED * ESTEPS] * n
    report = analyse(con)
    assert [w for w in report.warnings if "repeat" in w or "left out" in w] == [said], report.warnings
