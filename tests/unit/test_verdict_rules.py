"""The verdict's rules one at a time, on hand-built inputs (ingero.analysis.verdict): each
threshold on both sides of its figure, so a changed constant or a dropped test fails here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ingero.analysis.calls import Events
from ingero.analysis.model import RankRow
from ingero.analysis.replay import Measured
from ingero.analysis.stats import Retransmits
from ingero.analysis.steps import Timeline
from ingero.analysis.verdict import (Candidate, Loss, NetworkHit, OwnRunq, OwnWork, WhatIf, _against_network,
                                     _arbitrate, _named, _network, _offcpu_cause, _own_offcpu, _role_peers,
                                     _slow_nodes, _spread_beats)

MS = 1_000_000
TRACED = 6_000 * MS


def _two_nodes(steps: int = 20) -> tuple[Timeline, dict]:
    """Rank 0 on node a, rank 1 on node b, one sync event each per step: arrival at
    1000 * i, every dependency in at +200, the return at +500."""
    i = np.tile(np.arange(steps), 2)
    a = (1000 * i).astype(np.int64)
    ready, e = a + 200, a + 500
    rank = np.repeat([0, 1], steps)
    n = 2 * steps
    ev = Events(ranks=np.array([0, 1]), off=np.array([0, steps, n]), rank=rank, a=a, e=e,
                inst=np.full(n, -1), dep_ptr=np.zeros(n + 1, np.int64), dep_idx=np.zeros(0, np.int64),
                p2p_pairs=0, unpaired=0)
    m = Measured(w=np.full(n, 1000, np.int64), x=e - ready, ready=ready, crit=rank.copy())
    z = np.zeros(n, np.int64)
    tl = Timeline(ev=ev, m=m, role=z, key=z, inwin=np.ones(n, bool), marker_inst=np.array([0]), steps=steps,
                  stage_of={})
    rows = {r: RankRow(rank=r, node=nd, pod=None, pid=r) for r, nd in ((0, "a"), (1, "b"))}
    return tl, rows


def _retx(nodes: list, offset: int = 300) -> Retransmits:
    """One retransmit per step, `offset` ns after the step's arrivals, on the node given
    (owned by that node's rank)."""
    n = len(nodes)
    return Retransmits(ts=1000 * np.arange(n, dtype=np.int64) + offset,
                       rank=np.array([0 if nd == "a" else 1 for nd in nodes]), node=list(nodes),
                       local=np.zeros(n, bool))


def test_the_node_holding_two_thirds_of_the_retransmits_in_transfers_is_where_the_loss_is():
    tl, rows = _two_nodes()
    hit = _network(tl, rows, _retx(["a"] * 7 + ["b"] * 3))
    assert hit is not None and (hit.node, hit.rank, hit.single) == ("a", 0, True)
    assert hit.lead == "7 of 10 retransmits inside transfers are on a's connections (rank 0 owns 7)"
    assert hit.hit.sum() == 14 and hit.why.startswith(hit.lead + "; ") and not hit.rdma
    assert _network(tl, rows, _retx(["a"] * 8 + ["b"] * 2)).node == "a"


def test_retransmits_split_between_nodes_name_no_network():
    tl, rows = _two_nodes()
    assert _network(tl, rows, _retx(["a"] * 6 + ["b"] * 4)) is None      # 60% < 2/3
    assert _network(tl, rows, _retx(["a", "b"] * 5)) is None


def test_a_retransmit_while_a_rank_waits_for_its_peers_is_outside_the_transfer():
    tl, rows = _two_nodes()
    # between arrival (+0) and the last dependency's arrival (+200): waiting, not transferring
    assert _network(tl, rows, _retx(["a"] * 10, offset=100)) is None
    assert _network(tl, rows, _retx(["a"] * 10, offset=250)).node == "a"


def test_too_few_retransmits_in_transfers_are_no_cause():
    tl, rows = _two_nodes()
    assert _network(tl, rows, _retx(["a"] * 2)) is None
    assert _network(tl, rows, _retx(["a"] * 3)).node == "a"


def _io_rows(io_ms: dict) -> dict:
    return {r: RankRow(rank=r, node="a", pod=None, pid=r, offcpu_ms={"io": float(v)}) for r, v in io_ms.items()}


def test_io_wait_names_io_only_as_an_outlier_among_the_peers():
    # peers 100, 110, 120 ms: median 110, scale 1.4826 * 10 = 14.8 ms (over the 12 ms floor)
    assert _offcpu_cause(_io_rows({0: 165, 1: 100, 2: 110, 3: 120}), 0, 100 * MS, TRACED)[0] == "io"   # z 3.7
    cause, why = _offcpu_cause(_io_rows({0: 150, 1: 100, 2: 110, 3: 120}), 0, 100 * MS, TRACED)     # z 2.7
    assert cause == "compute/unknown", why


def test_io_wait_explaining_under_30_percent_of_the_excess_is_no_cause():
    rows = _io_rows({0: 400, 1: 100, 2: 110, 3: 120})                    # 290 ms over the peers' median
    cause, why = _offcpu_cause(rows, 0, 500 * MS, TRACED)                 # 58% of the excess
    assert cause == "io" and why == ("it spent 400 ms off-CPU in io wait vs a peer median of 110 ms (z 5.8), "
                                     "58% of its excess own work")
    assert _offcpu_cause(rows, 0, 1000 * MS, TRACED)[0] == "compute/unknown"   # 29%


def test_a_slow_node_slows_its_ranks_alike():
    rows = {r: RankRow(rank=r, node="abc"[r // 2], pod=None, pid=r) for r in range(6)}
    own = {0: 130.0, 1: 125.0, 2: 100.0, 3: 100.0, 4: 100.0, 5: 100.0}
    (slow,) = _slow_nodes(rows, own, {})
    assert (slow.node, slow.ranks, slow.ratio) == ("a", [0, 1], {0: 1.3, 1: 1.25})
    # one rank 30% over, the other 6%: two ranks of unequal excess, not a slow machine
    assert _slow_nodes(rows, {**own, 1: 106.0}, {}) == []
    # both 4% over: under NODE_SLOW
    assert _slow_nodes(rows, {**own, 0: 104.0, 1: 104.0}, {}) == []


def test_a_ranks_peers_are_the_ranks_of_its_own_role():
    own = {0: 10.0, 1: 12.0, 4: 11.0, 2: 30.0, 3: 34.0, 5: 50.0}
    role = {0: 0, 1: 0, 4: 0, 2: 1, 3: 1, 5: 2}
    assert _role_peers(own, role) == {0: 11.5, 1: 10.5, 4: 11.0, 2: 34.0, 3: 30.0, 5: 50.0}


def _cand(kind: str, saving_ms: float, ranks=(0,), cause="compute/unknown") -> Candidate:
    return Candidate(kind, list(ranks), saving_ms * MS, f"{kind} {ranks[0]}", cause=cause)


def test_spread_needs_its_floor_and_a_best_single_fix_under_half_of_it():
    spread = _cand("spread", 20.0)
    assert _spread_beats(spread, _cand("rank", 9.0), 100 * MS)
    assert not _spread_beats(spread, _cand("rank", 11.0), 100 * MS)
    assert _spread_beats(spread, None, 100 * MS)
    assert not _spread_beats(_cand("spread", 11.0), None, 100 * MS)      # 11% < 12%
    assert not _spread_beats(_cand("spread", 11.9), None, 100 * MS)


def test_a_rank_close_to_its_groups_saving_is_named_instead_of_the_group():
    j = SimpleNamespace(rows={}, tl=None, traced_ns=TRACED, own={}, peers_own={})
    none = _retx([])
    stage, rank = _cand("stage", 10.0, ranks=(0, 1)), _cand("rank", 9.2)
    assert _arbitrate(j, [stage, rank], none, 0) is rank                  # 92% of the stage's saving
    assert _arbitrate(j, [stage, _cand("rank", 8.5)], none, 0) is stage
    assert _arbitrate(j, [], none, 0) is None


def test_retransmits_inside_a_node_are_said_beside_a_rank_verdict():
    j = SimpleNamespace(rows={}, tl=None, traced_ns=TRACED, own={}, peers_own={})
    best = _arbitrate(j, [_cand("rank", 9.0)], _retx(["b", "b"]), 5)
    assert best.text() == ("; weighed against 2 retransmits on other ranks' connections, too few or too spread "
                           "out to be a lossy link; 5 retransmits on connections inside one node were not counted "
                           "as link loss (no wire: a receiver that does not drain its socket causes them)")


def test_a_rank_at_tie_share_of_its_group_exactly_is_named_even_beside_retransmits():
    j = SimpleNamespace(rows={}, tl=None, traced_ns=TRACED, own={}, peers_own={})
    stage, rank = _cand("stage", 10.0, ranks=(0, 1)), _cand("rank", 9.0)
    assert _arbitrate(j, [stage, rank], _retx([]), 0) is rank                  # 90% exactly
    stage, rank = _cand("stage", 10.0, ranks=(0, 1)), _cand("rank", 9.2)
    assert _arbitrate(j, [stage, rank], _retx(["a", "b"]), 0) is rank and stage.notes == []


def _rq_rows(rq: dict, waits: dict) -> dict:
    return {r: RankRow(rank=r, node="a" if r < 2 else "b", pod=None, pid=r, offcpu_ms={"runqueue": float(rq[r])},
                       offcpu_waits={"runqueue": waits[r]}) for r in rq}


def test_against_the_network_a_rank_with_its_own_io_wait_saving_half_as_much_is_the_cause():
    rows = _rq_rows({0: 300, 1: 300, 2: 300, 3: 300}, {0: 30, 1: 30, 2: 30, 3: 30})
    j = SimpleNamespace(rows=rows, tl=SimpleNamespace(steps=40), traced_ns=TRACED, own={}, peers_own={})
    net = _cand("network", 20.0, ranks=(2, 3), cause="network")
    io = _cand("rank", 10.0, ranks=(1,), cause="io")
    assert _against_network(j, net, [io]) is io
    assert _against_network(j, net, [_cand("rank", 9.0, ranks=(1,), cause="io")]) is net
    assert _against_network(j, net, [_cand("rank", 15.0, ranks=(1,))]) is net     # no off-CPU cause


def test_the_network_evidence_holds_its_figures():
    tl, rows = _two_nodes()
    hit = _network(tl, rows, _retx(["a"] * 9 + ["b"]))
    assert hit.share == 0.9
    assert hit.why == ("9 of 10 retransmits inside transfers are on a's connections (rank 0 owns 9); transfers with "
                       "one in flight take 0.0 ms at median vs 0.0 ms without, in 18 of 40 sync events, with "
                       "arrivals on time")
    tl.m.x[:] = 2_000_000                         # the transfers without a retransmit
    tl.m.x[tl.ev.a < 9000] = 6_000_000            # those of steps 0-8, with one
    hit = _network(tl, rows, _retx(["a"] * 9 + ["b"]))
    assert "take 6.0 ms at median vs 2.0 ms without, in 18 of 40" in hit.why


def test_retransmits_hitting_under_5_percent_of_the_sync_events_are_no_network():
    tl, rows = _two_nodes(steps=40)               # 80 sync events: 4 is 5%
    assert _network(tl, rows, _retx(["a"] * 3)).node == "a"              # 6 of 80 events
    tl, rows = _two_nodes(steps=70)               # 140 sync events: 6 is under 5% (7)
    assert _network(tl, rows, _retx(["a"] * 3)) is None


def test_a_node_of_several_ranks_is_named_as_a_node_unless_one_rank_owns_the_loss():
    tl, rows = _two_nodes()
    rows[2] = RankRow(rank=2, node="a", pod=None, pid=2)
    retx = _retx(["a"] * 9)
    owners = retx.rank.copy()
    hit = _network(tl, rows, retx)
    assert (hit.rank, hit.single) == (0, True)                            # rank 0 owns all 9
    owners[::2] = 2                                                       # 5 of 9 on rank 2: 56%
    hit = _network(tl, rows, retx._replace(rank=owners))
    assert (hit.rank, hit.single) == (2, False) and hit.lead.endswith("(rank 2 owns 5)")
    hit = _network(tl, rows, retx._replace(rank=np.full(9, -1)))          # no owner known
    assert (hit.rank, hit.single) == (0, False)
    assert "owns" not in hit.why


def test_a_slow_node_is_judged_against_the_same_role_elsewhere_and_the_slowest_comes_first():
    rows = {r: RankRow(rank=r, node="abcd"[r // 2], pod=None, pid=r) for r in range(8)}
    stage = {r: r % 2 for r in range(8)}                       # each node: one rank of each stage
    own = {0: 100.0, 1: 200.0, 2: 100.0, 3: 200.0, 4: 130.0, 5: 260.0, 6: 120.0, 7: 240.0}
    got = _slow_nodes(rows, own, stage)
    assert [(s.node, s.ranks) for s in got] == [("c", [4, 5]), ("d", [6, 7])]
    assert got[0].ratio == {4: 1.3, 5: 1.3}
    assert _slow_nodes({r: rows[r] for r in (0, 1)}, {0: 100.0, 1: 300.0}, {}) == []    # under 3 ranks


def test_against_the_network_fix_the_best_rank_says_what_it_was_weighed_against():
    rows = _rq_rows({0: 300, 1: 300, 2: 300, 3: 300}, {0: 30, 1: 30, 2: 30, 3: 30})
    j = SimpleNamespace(rows=rows, tl=SimpleNamespace(steps=40), traced_ns=TRACED, own={}, peers_own={})
    net = _cand("network", 20.0, ranks=(2, 3), cause="network")
    io = _cand("rank", 12.0, ranks=(1,), cause="io")
    best = _arbitrate(j, [net, io], _retx([]), 0)
    assert best is io and best.text() == ("; weighed against network 2's retransmits (fixing the transfers they "
                                          "slow would save 20.0 ms/step), which a rank answering late causes "
                                          "without any loss")
    assert _arbitrate(j, [net, _cand("rank", 12.0, ranks=(1,))], _retx([]), 0) is net
    rank = _cand("rank", 30.0, ranks=(1,))
    assert _arbitrate(j, [rank, net], _retx([]), 0) is rank and "weighed against network 2's" in rank.text()
    node = _cand("node", 10.0, ranks=(0, 1))
    assert _arbitrate(j, [node, _cand("rank", 9.5)], _retx([]), 0).kind == "rank"


def test_against_the_network_a_rank_starved_at_each_wait_is_the_cause_and_the_fix_is_said_to_0_1_ms():
    # rank 1: 100 ms a wait vs its peers' 10 ms
    rows = _rq_rows({0: 300, 1: 300, 2: 300, 3: 300}, {0: 30, 1: 3, 2: 30, 3: 30})
    j = SimpleNamespace(rows=rows, tl=SimpleNamespace(steps=40), traced_ns=TRACED, own={}, peers_own={})
    net = _cand("network", 20.0500005, ranks=(2, 3), cause="network")
    cpu = _cand("rank", 12.0, ranks=(1,), cause="cpu-contention")
    assert _arbitrate(j, [net, cpu], _retx([]), 0) is cpu and "would save 20.1 ms/step" in cpu.text()
    # the same wait in ten times as many waits: woken more often, not starved
    j.rows = _rq_rows({0: 300, 1: 300, 2: 300, 3: 300}, {0: 30, 1: 30, 2: 30, 3: 30})
    assert _arbitrate(j, [net, _cand("rank", 12.0, ranks=(1,), cause="cpu-contention")], _retx([]), 0) is net


def test_spread_at_its_floor_exactly_and_a_best_fix_at_half_exactly():
    spread = _cand("spread", 12.0)
    assert _spread_beats(spread, None, 100 * MS)                          # 12% is enough
    assert not _spread_beats(spread, _cand("rank", 6.0), 100 * MS)        # half is not under half
    assert not _spread_beats(_cand("spread", 0.0), None, 0.0 + 1)


def test_only_a_rank_has_an_off_cpu_cause_of_its_own():
    rows = _rq_rows({0: 400, 1: 100, 2: 100, 3: 100}, {0: 10, 1: 10, 2: 10, 3: 10})     # 4x per wait exactly
    assert _own_offcpu(rows, _cand("rank", 9.0, cause="cpu-contention"))
    assert not _own_offcpu(rows, _cand("stage", 9.0, cause="io"))
    assert not _own_offcpu(rows, _cand("rank", 9.0, ranks=(1,), cause="cpu-contention"))


def test_the_named_candidate_is_the_best_fix_over_the_floor():
    j = SimpleNamespace(rows={}, base_step=100 * MS, work_step=100 * MS, pct=lambda k: 100.0 * k.saving_ns / (100 * MS))
    spread = _cand("spread", 5.0)
    assert _named(j, _cand("rank", 5.0), spread).kind == "rank"
    assert _named(j, _cand("rank", 4.9), spread) is None
    assert _named(j, None, spread) is None


def test_a_second_off_cpu_reason_is_said_beside_the_first():
    rows = {r: RankRow(rank=r, node="a", pod=None, pid=r, offcpu_ms={"io": float(io), "runqueue": float(rq)})
            for r, (io, rq) in enumerate([(400, 600), (100, 100), (110, 110), (120, 120)])}
    cause, why = _offcpu_cause(rows, 0, 500 * MS, TRACED)
    assert cause == "cpu-contention"
    assert why.endswith("; also 400 ms off-CPU in io wait vs a peer median of 110 ms (3.6x its peers', against "
                        "5.5x for runqueue)")


def test_a_rank_starved_behind_the_retransmits_takes_the_network_fixs_saving_and_replay():
    # rank 3: 2.3 s in the runqueue in 23 waits (100 ms each) vs peers ~250 ms in 30-89 waits
    rows = _rq_rows({0: 335, 1: 300, 2: 235, 3: 2331}, {0: 31, 1: 40, 2: 89, 3: 23})
    j = SimpleNamespace(rows=rows, tl=SimpleNamespace(steps=40), traced_ns=TRACED, own={3: 50 * MS},
                        peers_own={3: 52 * MS})
    loss = Loss(200, 230, "b", 2, 150)
    net = _cand("network", 20.0, ranks=(2, 3), cause="network")
    net.net = NetworkHit("b", np.zeros(0, bool), loss.text(), 0.87, 2, False, lead=loss.text())
    net.whatif = WhatIf(None, np.zeros(0, np.int64))
    k = _against_network(j, net, [])
    assert (k.kind, k.ranks, k.cause, k.saving_ns) == ("rank", [3], "cpu-contention", net.saving_ns)
    assert (k.label, k.score, k.whatif, k.own) == ("rank 3", 39.14, net.whatif, OwnWork(50 * MS, 52 * MS))
    assert k.why == ("it spent 2331 ms waiting in the runqueue vs a peer median of 300 ms (z 39.1), 50.8 ms/step "
                     "more, 13.5x its peers' wait each time it came back from off-CPU; the transfers slowed with "
                     "retransmits in flight on b's connections (200 of 230 retransmits inside transfers are on b's "
                     "connections (rank 2 owns 150)) are what a rank answering late causes without any loss: fixing "
                     "them would save 20.0 ms/step, and a lossy link leaves its ranks on CPU")
    assert _against_network(SimpleNamespace(**{**vars(j), "tl": SimpleNamespace(steps=0)}), net, []) is net
    net.saving_ns = 102 * MS                                              # its 50.8 ms/step: under half of it
    assert _against_network(j, net, []) is net


def test_runqueue_wait_inside_its_own_work_is_said_with_its_figures():
    rows = _rq_rows({0: 851, 1: 354, 2: 438, 3: 522}, {0: 492, 1: 354, 2: 438, 3: 522})    # 1.7x per wait
    own = OwnRunq(mine=32.58 * MS, peers=12 * MS, share=2.1, steps=20)
    cause, why = _offcpu_cause(rows, 0, 196 * MS, TRACED, own)
    assert (cause, why) == ("cpu-contention", "it spent 32.6 ms/step waiting for a CPU inside its own work vs 12.0 "
                            "ms at its peers' rate, 210% of its excess own work (851 ms of runqueue wait in all vs 438 ms, "
                            "1.7x its peers' per off-CPU interval)")
    assert _offcpu_cause(rows, 0, 196 * MS, TRACED, own._replace(share=0.5))[0] == "cpu-contention"
    assert _offcpu_cause(rows, 0, 196 * MS, TRACED, own._replace(share=0.49))[0] == "compute/unknown"


def _at(nodes: list, owners: list, steps: int) -> Retransmits:
    """One retransmit per step, 300 ns after its arrivals, on `nodes`, owned by `owners`."""
    return Retransmits(ts=1000 * np.arange(len(nodes), dtype=np.int64) + 300, rank=np.array(owners), node=nodes,
                       local=np.zeros(len(nodes), bool))


def test_two_thirds_of_the_retransmits_is_67_in_100_exactly():
    tl, rows = _two_nodes(100)
    rows[2] = RankRow(rank=2, node="a", pod=None, pid=2)                 # a second rank on node a, no events
    hit = _network(tl, rows, _at(["a"] * 67 + ["b"] * 33, [0] * 67 + [1] * 33, 100))
    assert hit is not None and hit.node == "a" and hit.share == 0.67
    assert _network(tl, rows, _at(["a"] * 66 + ["b"] * 34, [0] * 66 + [1] * 34, 100)) is None
    # all on node a: rank 0 owning 67 of them is the rank behind it, 66 leaves it to the node
    hit = _network(tl, rows, _at(["a"] * 100, [0] * 67 + [2] * 33, 100))
    assert (hit.rank, hit.single) == (0, True)
    assert not _network(tl, rows, _at(["a"] * 100, [0] * 66 + [2] * 34, 100)).single


def test_the_share_of_the_loss_is_said_to_two_places():
    tl, rows = _two_nodes()
    assert _network(tl, rows, _retx(["a"] * 11 + ["b"] * 5)).share == 0.69


def test_retransmits_hitting_5_percent_of_the_sync_events_exactly_are_a_network():
    tl, rows = _two_nodes()                                               # 40 sync events in the window
    three = Retransmits(ts=np.array([250, 300, 350]), rank=np.zeros(3, np.int64), node=["a"] * 3,
                        local=np.zeros(3, bool))                          # all in step 0: 2 events
    hit = _network(tl, rows, three)
    assert hit is not None and hit.hit.sum() == 2


def test_retransmits_on_a_node_without_a_traced_rank_name_the_node_and_no_rank():
    tl, rows = _two_nodes()
    hit = _network(tl, rows, _at(["c"] * 5, [-1] * 5, 5))
    assert hit is not None and (hit.node, hit.rank, hit.single) == ("c", None, False)


def test_the_network_evidence_says_what_nccls_proxy_saw():
    tl, rows = _two_nodes()
    rows[0].net_wait_ms, rows[1].net_wait_ms = 50.0, 5.0
    hit = _network(tl, rows, _retx(["a"] * 10))
    assert hit.why.endswith("; NCCL's proxy: a's ranks' sends waited up to 50 ms on the network, the other "
                            "ranks' 5 ms at median"), hit.why


def test_a_node_is_not_slow_against_a_reference_that_did_no_work():
    rows = {r: RankRow(rank=r, node="abc"[r // 2], pod=None, pid=r) for r in range(6)}
    assert _slow_nodes(rows, {0: 5.0, 1: 5.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0}, {}) == []
