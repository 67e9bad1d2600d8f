"""What the verdict is built on, on hand-built calls (ingero.analysis.calls, steps): which
sync events wait for which, which calls are one event, which communicators make a pipeline,
which collective marks the step and which events the step window holds; and which
retransmits `analyse` judges as link loss."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from ingero import schema
from ingero.analysis import analyse
from ingero.analysis.calls import Calls, events, load
from ingero.analysis.replay import measure
from ingero.analysis.steps import markers, stages, timeline

US = 1_000


def _con(rows: list[tuple], node=lambda g: "n") -> duckdb.DuckDBPyConnection:
    """Calls from (global rank, comm hash, members, t µs, duration µs, op, peer) rows, each
    rank's in order; a rank's communicator rank is its place among the members, a call's seq
    its number on that rank and communicator (group calls: comm hash 0), its process 100 + rank
    on `node(rank)`."""
    con = duckdb.connect()
    schema.create_all(con)
    seq: dict = {}
    out = []
    for i, (g, h, mem, t, d, op, peer) in enumerate(rows, 1):
        n = seq[g, h] = seq.get((g, h), -1) + 1
        out.append((i, node(g), 100 + g, g, mem.index(g), len(mem), h or None, n if h else None, t * US, d * US,
                    op, mem.index(peer) if peer is not None else None))
    con.executemany("""INSERT INTO nccl_events (event_id, node, pid, global_rank, rank, nranks, comm_id_hash,
                       seq, timestamp_ns, duration_ns, op, peer, ret) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)""",
                    out)
    return con


def _calls(rows: list[tuple]) -> Calls:
    return load(_con(rows))[0]


def _deps(ev, i: int) -> list[int]:
    return ev.dep_idx[ev.dep_ptr[i]:ev.dep_ptr[i + 1]].tolist()


def _send_recv(send_us: int) -> Calls:
    """Rank 0 sends to rank 1 at 0 (returning at `send_us`); rank 1 posts the receive at 50."""
    p = [0, 1]
    return _calls([(0, 0xB, p, 0, send_us, "SEND", 1), (1, 0xB, p, 50, 60, "RECV", 0)])


def test_an_eager_send_waits_for_nobody_and_a_rendezvous_send_waits_for_its_receive():
    ev = events(_send_recv(30))           # returned before the receive was posted: eager
    assert ev.rank.tolist() == [0, 1] and ev.p2p_pairs == 1
    assert (_deps(ev, 0), _deps(ev, 1)) == ([], [0])
    ev = events(_send_recv(100))          # returned after it: the send waited for the receive
    assert (_deps(ev, 0), _deps(ev, 1)) == ([1], [0])


def test_a_plain_group_of_a_send_and_a_receive_is_one_sync_event_per_rank():
    p, rows = [0, 1], []
    for g in (0, 1):
        rows += [(g, 0, p, 0, 1, "GROUP_START", None), (g, 0xB, p, 1, 1, "SEND", 1 - g),
                 (g, 0xB, p, 2, 1, "RECV", 1 - g), (g, 0, p, 3, 20, "GROUP_END", None)]
    ev = events(_calls(rows))
    assert ev.rank.tolist() == [0, 1]
    assert (set(_deps(ev, 0)), set(_deps(ev, 1))) == ({1}, {0})     # each waits for the other


def _p2p_only(pairs: list[tuple[int, int]]) -> Calls:
    """A communicator of ranks 0-3 used only for sends and receives between `pairs`, each 3 times."""
    mem, rows = [0, 1, 2, 3], []
    for k in range(3):
        for s, r in pairs:
            rows += [(s, 0xC, mem, 100 * k, 5, "SEND", r), (r, 0xC, mem, 100 * k + 1, 5, "RECV", s)]
    return _calls(rows)


def test_a_communicator_of_sends_between_neighbours_is_a_pipeline_and_others_are_not():
    assert stages(_p2p_only([(0, 1), (1, 2), (2, 3)])) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert stages(_p2p_only([(0, 2), (1, 3)])) == {}          # two hops apart: no pipeline order


def test_sends_and_receives_whose_peers_are_unknown_give_no_stages():
    """Ranks attached late on a busy node: their p2p calls on a recovered communicator
    carry no peer (a lossy-link whole flow of a loaded CI run ended MergeFailed here)."""
    mem = [2, 3]
    c = _calls([(g, 0xD, mem, 10 * k + g, 5, op, None)
                for k in range(3) for g, op in ((2, "SEND"), (3, "RECV"))])
    assert (c.peer < 0).all() and stages(c) == {}


def _job(steps: int, extra: list[tuple] = ()) -> Calls:
    """Ranks 0 and 1: an all-reduce per step on communicator 0xA, 1 ms apart."""
    p = [0, 1]
    return _calls([(g, 0xA, p, 1000 * k + 10 * g, 100, "ALL_REDUCE", None)
                   for k in range(steps) for g in p] + list(extra))


def test_a_collective_made_twice_is_no_step_marker_beside_one_that_recurs():
    p = [0, 1]
    setup = [(g, 0xD, p, -5000 + 1000 * k, 10, "ALL_GATHER", None) for k in range(2) for g in p]
    c = _job(6, setup)
    (comm, op), = markers(c, np.ones(len(c.inst_size), bool))
    assert int(c.comm_hash[comm]) == 0xA


@pytest.mark.parametrize("at_us", [-300, -60_000, 10_100], ids=["start-up", "idle-start-up", "at-the-end"])
def test_a_collective_made_only_at_one_end_is_no_step_marker_beside_one_that_recurs(at_us):
    """3 broadcasts 100 µs apart before the first step (a DDP job's at init; long before it:
    the first step compiled), or after the last (a checkpoint): made least often, but not
    through the job."""
    p = [0, 1]
    c = _job(10, [(g, 0xD, p, at_us + 100 * k, 10, "BROADCAST", None) for k in range(3) for g in p])
    (comm, op), = markers(c, np.ones(len(c.inst_size), bool))
    assert int(c.comm_hash[comm]) == 0xA


def test_the_step_window_ends_at_the_last_boundary():
    p = [0, 1]
    after = [(g, 0xD, p, 5500, 10, "BROADCAST", None) for g in p]    # after the 6th all-reduce
    c = _job(6, after)
    ev = events(c)
    tl = timeline(c, ev, measure(ev))
    assert tl is not None and tl.steps == 5
    late = ev.a >= 5500 * US
    assert late.sum() == 2 and not tl.inwin[late].any()
    assert tl.inwin.sum() == 10                           # steps 1-5 of both ranks


def _lossy(daddr: str):
    """Ranks 0-1 on node a (10.0.0.1), 2-3 on b (10.0.0.2): an all-reduce of all four every
    20 ms, its transfer 2 ms, 10 ms in steps 3, 8 and 13, each with a retransmit of rank 0's
    to `daddr` in flight."""
    p, slow = [0, 1, 2, 3], (3, 8, 13)
    con = _con([(g, 0xA, p, 20_000 * k, 10_000 if k in slow else 2_000, "ALL_REDUCE", None)
                for g in p for k in range(20)], node=lambda g: "ab"[g // 2])
    con.execute("""INSERT INTO ranks (node, pid, rank, addresses) VALUES ('a', 100, 0, '10.0.0.1'),
                   ('a', 101, 1, '10.0.0.1'), ('b', 102, 2, '10.0.0.2'), ('b', 103, 3, '10.0.0.2')""")
    for k in slow:
        con.execute("""INSERT INTO tcp_events (timestamp_ns, event, saddr, daddr, node, pid)
                       VALUES (?, 'tcp_retransmit_skb', '10.0.0.1', ?, 'a', 100)""", [(20_000 * k + 5_000) * US, daddr])
    return analyse(con)


def test_retransmits_on_a_connection_inside_a_node_are_no_link_loss():
    rep = _lossy("10.0.0.2")                              # to the other node: over the wire
    assert rep.straggler is not None and rep.straggler.cause == "network", rep.straggler
    rep = _lossy("10.0.0.1")                              # to its own node's address: no wire
    assert rep.straggler is None and rep.retransmits == 3, rep.straggler
