"""A starved rank makes its peers retransmit: the network verdict yields to it only when the
timeline says it was starved (ingero.analysis: retransmits inside a node, `_starved_behind`).

Figures from the lab's 2x2 cpu-hog on a busy machine (2026-11-25, load 13-34): a network
verdict named rank 2 (sending to the starved rank 3 on the same node: 79 of 112
retransmits were inside the node) or node b (229 of 271 retransmits), while rank 3 waited
in the runqueue far longer each time it woke than its peers."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from ingero import schema
from ingero.analysis.model import RankRow
from ingero.analysis.stats import retransmits
from ingero.analysis.verdict import Candidate, Loss, NetworkHit, _starved_behind

MS = 1_000_000


def test_retransmits_inside_a_node_are_marked_local():
    con = duckdb.connect()
    schema.create_all(con)
    con.execute("""INSERT INTO ranks (node, pid, rank, addresses) VALUES
                   ('a', 10, 0, '10.0.0.1,fd00::1'), ('a', 11, 1, '10.0.0.1,fd00::1'),
                   ('b', 20, 2, '10.0.0.2'), ('c', 30, 3, '10.0.0.3')""")
    rows = [(1, "a", "10.0.0.1", "10.0.0.2", 10),   # to another node: the wire
            (2, "a", "10.0.0.1", "10.0.0.1", 11),   # to itself
            (3, "a", "fd00::1", "::1", 10),         # loopback
            (4, "b", "10.0.0.2", "10.0.0.3", 20),   # to another node
            (5, "c", "10.0.0.7", "10.0.0.3", 30)]   # to an address of its own node's pods
    for ts, node, s, d, pid in rows:
        con.execute("""INSERT INTO tcp_events (timestamp_ns, event, saddr, daddr, node, pid)
                       VALUES (?, 'tcp_retransmit_skb', ?, ?, ?, ?)""", [ts, s, d, node, pid])
    ts, rk, nodes, local = retransmits(con)
    assert ts.tolist() == [1, 2, 3, 4, 5]
    assert rk.tolist() == [0, 1, 0, 2, 3]
    assert local.tolist() == [False, True, True, False, True]


class _TL:
    steps = 40


def _rows(rq: dict, waits: dict) -> dict:
    return {r: RankRow(rank=r, node="a" if r < 2 else "b", pod=None, pid=r,
                       offcpu_ms={"runqueue": float(rq[r])}, offcpu_waits={"runqueue": waits[r]})
            for r in rq}


def _net(saving_ms: float) -> Candidate:
    loss = Loss(200, 230, "b", 3, 150)
    hit = NetworkHit("b", np.zeros(0, bool), f"{loss.text()}; more", 0.87, 3, False, lead=loss.text())
    return Candidate("network", [2, 3], saving_ms * MS, "node b", cause="network", why=hit.why, net=hit)


def test_a_rank_starved_each_time_it_wakes_takes_the_network_verdict():
    # rank 3: 2.3 s in the runqueue in 23 waits (100 ms each) vs peers ~250 ms in 30-320 waits
    rows = _rows({0: 335, 1: 300, 2: 235, 3: 2331}, {0: 31, 1: 40, 2: 89, 3: 23})
    k = _starved_behind(_net(20.0), rows, _TL(), 6_000 * MS, {3: 50 * MS}, {3: 52 * MS})
    assert k is not None and k.ranks == [3] and k.cause == "cpu-contention"
    assert k.saving_ns == 20.0 * MS and "runqueue" in k.why and "each time" in k.why


def test_a_lossy_links_sender_woken_more_often_keeps_the_network_verdict():
    # the GPU-like lossy-link victim: twice its peers' runqueue wait, in more waits of ~the same length
    rows = _rows({0: 928, 1: 981, 2: 1496, 3: 2053}, {0: 240, 1: 209, 2: 259, 3: 328})
    assert _starved_behind(_net(49.0), rows, _TL(), 6_000 * MS, {}, {}) is None


def test_a_starved_rank_whose_wait_is_too_small_to_explain_the_network_fix_does_not_take_it():
    rows = _rows({0: 335, 1: 300, 2: 235, 3: 700}, {0: 31, 1: 40, 2: 89, 3: 5})
    # 465 ms over 40 steps is 11.6 ms/step: under half of a 49 ms/step network fix
    assert _starved_behind(_net(49.0), rows, _TL(), 6_000 * MS, {}, {}) is None


def test_a_starved_ranks_what_if_shortens_the_transfers_it_takes_part_in_and_no_others():
    from ingero.analysis.calls import Events
    from ingero.analysis.replay import Measured
    from ingero.analysis.steps import Timeline
    from ingero.analysis.verdict import _starved_x

    # events by rank: rank 0 [instance 0, a recv from rank 2], rank 1 [instance 0, instance 1
    # (a collective without rank 2)], rank 2 [instance 0, a send to rank 0]
    rank = np.array([0, 0, 1, 1, 2, 2])
    inst = np.array([0, -1, 0, 1, 0, -1])
    dep_ptr = np.array([0, 0, 1, 1, 1, 1, 1])      # event 1 (rank 0's recv) depends on event 5 (rank 2's send)
    dep_idx = np.array([5])
    z = np.zeros(6, np.int64)
    ev = Events(ranks=np.array([0, 1, 2]), off=np.array([0, 2, 4, 6]), rank=rank, a=z, e=z, inst=inst,
                dep_ptr=dep_ptr, dep_idx=dep_idx, p2p_pairs=1, unpaired=0)
    m = Measured(w=z, x=np.full(6, 1000, np.int64), ready=z, crit=rank.copy())
    tl = Timeline(ev=ev, m=m, role=z, key=z, inwin=np.ones(6, bool), marker_inst=np.array([0]), steps=1,
                  stage_of={})
    x = _starved_x(tl, 2, 0.5)
    # rank 2's own events, every member of instance 0, and rank 0's recv of its send: halved;
    # rank 1's instance 1 (without rank 2): untouched
    assert x.tolist() == [500, 500, 500, 1000, 500, 500]


def _three(rq0: float = 1000.0) -> dict:
    """Three ranks: rank 0 on node b starved (100 ms a wait), rank 1 beside it with no runqueue
    time recorded, rank 2 on node a (2 ms a wait)."""
    return {0: RankRow(rank=0, node="b", pod=None, pid=0, offcpu_ms={"runqueue": rq0},
                       offcpu_waits={"runqueue": 10}),
            1: RankRow(rank=1, node="b", pod=None, pid=1, offcpu_waits={"runqueue": 10}),
            2: RankRow(rank=2, node="a", pod=None, pid=2, offcpu_ms={"runqueue": 20.0},
                       offcpu_waits={"runqueue": 10})}


class _OneStep:
    steps = 1


def test_three_ranks_and_one_step_are_enough_to_find_the_starved_rank_and_its_figures():
    # rank 1 has no runqueue time: 0 ms, so its peers' median is 10 ms and rank 0 is
    # 990.05 ms over it in the one step, 100 ms a wait vs a median of 1 ms
    k = _starved_behind(_net(1980.0500005), _three(1000.0500005), _OneStep(), 1_000 * MS, {}, {})
    assert k is not None and k.ranks == [0] and k.score == 66.78
    assert k.own == (0.0, 0.0)
    assert k.why.startswith("it spent 1000 ms waiting in the runqueue vs a peer median of 10 ms (z 66.8), "
                            "990.1 ms/step more, 100.0x its peers' wait each time")
    assert "fixing them would save 1980.1 ms/step" in k.why


def test_a_starved_wait_of_exactly_half_the_network_fix_takes_it_and_a_hair_less_does_not():
    assert _starved_behind(_net(1980.0), _three(), _OneStep(), 1_000 * MS, {}, {}) is not None
    assert _starved_behind(_net(1980.001), _three(), _OneStep(), 1_000 * MS, {}, {}) is None


def test_a_starved_rank_never_takes_an_rdma_verdict():
    net = _net(1980.0)
    net.net.rdma = True
    assert _starved_behind(net, _three(), _OneStep(), 1_000 * MS, {}, {}) is None


@pytest.mark.parametrize("at, below, waits, saving_ms", [
    (142, 141.9, {0: 10, 1: 10, 2: 10, 3: 2}, 2.0),     # 42 ms over three peers alike: z 3.5 on the 12 ms floor
    (400, 399, {0: 10, 1: 10, 2: 10, 3: 10}, 10.0),     # 40 ms a wait against their 10: 4x exactly
])
def test_a_starved_rank_on_its_thresholds_exactly_takes_the_network_verdict(at, below, waits, saving_ms):
    k = _starved_behind(_net(saving_ms), _rows({0: 100, 1: 100, 2: 100, 3: at}, waits), _TL(), 6_000 * MS, {}, {})
    assert k is not None and k.ranks == [3]
    assert _starved_behind(_net(saving_ms), _rows({0: 100, 1: 100, 2: 100, 3: below}, waits), _TL(), 6_000 * MS,
                           {}, {}) is None
