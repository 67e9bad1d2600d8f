"""Communicators created before tracing began get an identity from their calls
(ingero/analysis/recover.py), on hand-built traces of a job attached late.

The job: 4 ranks on 2 nodes; a world communicator W (an all-reduce per step and a
ring send/recv in a group) and one node-local communicator per node (L0 = ranks
0, 1 and L1 = ranks 2, 3: a reduce-scatter per step, same op and count on both).
Every handle is unknown to the probes (comm_id_hash 0, rank -1) and each rank's
seq counts from the first call it was traced in, which differs per rank.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from ingero import schema
from ingero.analysis import analyse
from ingero.analysis.calls import events, load

T0 = 1_760_000_000_000_000_000
STEP = 100_000_000
MS = 1_000_000


NAMES = ("event_id", "node", "pid", "global_rank", "rank", "nranks", "comm_id_hash", "seq", "timestamp_ns",
         "duration_ns", "op", "comm", "count", "bytes", "datatype", "peer")


def _trace(rows: list[tuple]) -> duckdb.DuckDBPyConnection:
    """An in-memory trace holding `rows` (in NAMES' order) as nccl_events, all returned 0."""
    con = duckdb.connect()
    schema.create_all(con)
    con.register("calls", pa.table({k: [row[i] for row in rows] for i, k in enumerate(NAMES)}))
    con.execute(f"INSERT INTO nccl_events ({', '.join(NAMES)}, ret) SELECT *, 0 FROM calls")
    return con


def _job(steps=30, missed=(0, 1, 0, 2), blocking=True, node_skew_ms=3.0, ranks=(0, 1, 2, 3),
         profiler_ranks=(), slow_rank=None, seed=1):
    """A DuckDB connection holding the trace. `missed[r]`: steps rank r ran before tracing
    began (its calls then are not in the trace); `blocking`: calls return when the
    collective completes (a CPU NCCL), else right after they are queued (a GPU)."""
    rng = np.random.default_rng(seed)
    rows = []
    seqs: dict = {}
    eid = [0]

    def call(r, ptr, op, t, d, count=262144, peer=-1):
        if r not in ranks:
            return
        if op in ("GROUP_START", "GROUP_END"):
            s, ptr = None, 0
        else:
            k = (r, ptr, op in ("SEND", "RECV"))
            s = seqs.get(k, 0)
            seqs[k] = s + 1
        eid[0] += 1
        rows.append((eid[0], f"n{r // 2}", 100 + r, r, -1, -1, 0, s, int(t), int(d), op, ptr, count,
                     count * 4, "float32", peer))

    for step in range(steps):
        base = T0 + step * STEP
        own = {r: 40 * MS * (2 if r == slow_rank else 1) + rng.integers(0, MS) for r in ranks}
        arrive = {r: base + own[r] for r in ranks}
        last = max(arrive.values())
        for r in ranks:
            if step < missed[r]:
                continue
            end = last + 2 * MS + rng.integers(0, 50_000) if blocking else arrive[r] + 30_000
            call(r, 0xA000 + r, "ALL_REDUCE", arrive[r], end - arrive[r])
        # node-local reduce-scatter: node 1 runs its own a few ms after node 0
        for node in (0, 1):
            members = (2 * node, 2 * node + 1)
            t0 = last + 3 * MS + node * node_skew_ms * MS
            for r in members:
                if step < missed[r]:
                    continue
                a = t0 + rng.integers(0, 200_000)
                end = t0 + 1 * MS + rng.integers(0, 50_000) if blocking else a + 20_000
                call(r, 0xB000 + 16 * r, "REDUCE_SCATTER", a, end - a)
        g = last + 10 * MS
        for r in ranks:
            if step < missed[r]:
                continue
            call(r, 0, "GROUP_START", g, 1000)
            call(r, 0xA000 + r, "SEND", g + 2000, 1000, count=1024, peer=(r + 1) % 4)
            call(r, 0xA000 + r, "RECV", g + 4000, 1000, count=1024, peer=(r - 1) % 4)
            call(r, 0, "GROUP_END", g + 6000, MS)
    con = _trace(rows)
    for r in profiler_ranks:
        con.execute("INSERT INTO nccl_profiler_events (node, pid, global_rank, device_start_ns, device_end_ns) "
                    "VALUES (?, ?, ?, ?, ?)", [f"n{r // 2}", 100 + r, r, T0, T0 + 1000])
    return con


def _groups(c) -> dict:
    """comm code -> sorted global ranks, for the communicators of the calls."""
    return {k: v for k, v in c.comm_members.items()}


def test_handles_of_one_communicator_are_grouped_and_lookalikes_kept_apart():
    c, warnings = load(_job())
    assert sorted(map(tuple, _groups(c).values())) == [(0, 1), (0, 1, 2, 3), (2, 3)]
    assert sum("recovered from call sequences" in w for w in warnings) == 3, warnings
    # each node-local group is told from the other by calls that did not overlap in time
    assert all("confidence 1.00" in w for w in warnings if "recovered from" in w), warnings


def test_seq_numbers_are_aligned_across_ranks_after_a_late_start():
    c, _ = load(_job(missed=(0, 1, 0, 2)))
    coll = c.inst >= 0
    # every instance holds one call per member, all from the same step
    step = (c.t - T0) // STEP
    for i in np.unique(c.inst[coll]):
        sel = c.inst == i
        assert len(np.unique(step[sel])) == 1
        assert len(np.unique(c.rank[sel])) == sel.sum()
    # the world all-reduces of the steps every rank was traced in: one instance of 4 each
    ar = coll & (c.inst_size[np.maximum(c.inst, 0)] == 4)
    assert len(np.unique(c.inst[ar])) == 30 - 2        # steps every rank was traced in


def test_sends_and_receives_cut_apart_by_the_start_pair_again():
    # rank 1 was traced from step 1, rank 3 from step 2: rank 0's first send to rank 1 and
    # rank 2's first two sends to rank 3 have no receive in the trace, nor rank 0's first
    # receives from rank 3; without dropping them every later pair would be one step off
    ev = events(load(_job(missed=(0, 1, 0, 2)))[0])
    assert ev.unpaired <= 4, ev.unpaired
    assert ev.p2p_pairs >= 4 * (30 - 2) - 4


def test_a_handle_no_other_rank_shares_is_left_out_with_a_warning():
    # only ranks 0 and 2 traced: their node-local handles have no partner, and their world
    # handles agree but the ring's peers (ranks 1 and 3 of 4) do not fit a world of 2
    c, warnings = load(_job(ranks=(0, 2), missed=(0, 0, 0, 0)))
    assert c.comm_members == {}
    assert any("matched no other rank's calls and were left out" in w and "ranks 0, 2" in w
               for w in warnings), warnings
    assert any("groups of handles whose calls agree were left out" in w and "(ranks 0, 2 (0." in w for w in warnings), warnings


def test_enqueued_calls_are_matched_by_time_and_their_confidence_says_nothing_proves_them():
    # GPU-like: calls return at once, so the overlap test cannot run; node 1's
    # reduce-scatter runs 3 ms after node 0's, so end-time gaps still tell them apart
    c, warnings = load(_job(blocking=False))
    assert sorted(map(tuple, _groups(c).values())) == [(0, 1), (0, 1, 2, 3), (2, 3)]
    lines = [w for w in warnings if "recovered from" in w]
    assert len(lines) == 3 and all("confidence 0.50 (calls only enqueue work" in w for w in lines), warnings
    # in step, the node-local pairs look like one communicator of 4: said with the same confidence
    c, warnings = load(_job(blocking=False, node_skew_ms=0.0))
    assert (0, 1, 2, 3) in map(tuple, _groups(c).values())
    assert all("confidence 0.50" in w for w in warnings if "recovered from" in w), warnings


def test_late_attached_ranks_without_device_times_are_named():
    _, warnings = load(_job(profiler_ranks=(0, 1)))
    note = [w for w in warnings if "no device times" in w]
    assert len(note) == 1 and "ranks 2, 3 were traced after" in note[0], warnings


def test_known_communicators_are_left_alone():
    con = _job()
    con.execute("UPDATE nccl_events SET comm_id_hash = 7, rank = global_rank, nranks = 4 "
                "WHERE comm BETWEEN 40960 AND 40963")           # W: created after tracing began
    c, warnings = load(con)
    w = int(np.flatnonzero(c.comm_hash == 7)[0])
    assert c.comm_members[w] == [0, 1, 2, 3]
    assert sum("recovered from" in x for x in warnings) == 2, warnings   # L0 and L1


@pytest.mark.parametrize("victim", [1, 3])
def test_a_late_attached_trace_names_the_slow_rank(victim):
    rep = analyse(_job(slow_rank=victim, missed=(0, 2, 1, 0)))
    assert rep.straggler is not None and rep.straggler.rank == victim, rep.warnings


def _pipeline(steps=20, micro=4, missed=(0, 0, 2, 1), woken_late_ms=0):
    """Two 2-stage pipelines (ranks 0 -> 2 and 1 -> 3) that only send and receive, on handles
    the probes never saw created; stage 1's crank is 1. `missed[r]`: microbatches rank r
    ran before tracing began. The second pipeline runs 2 ms behind the first. A receive
    returns up to `woken_late_ms` after its data came (a busy machine)."""
    rng = np.random.default_rng(5)
    rows, seqs, n = [], {}, {r: 0 for r in range(4)}

    def call(r, op, t, d, peer):
        n[r] += 1
        if n[r] <= 2 * missed[r]:
            return
        s = seqs.get(r, 0)
        seqs[r] = s + 1
        if op == "RECV":
            d += int(rng.integers(0, woken_late_ms * MS + 1))
        rows.append((len(rows) + 1, f"n{r % 2}", 100 + r, r, -1, -1, 0, s, int(t), int(d), op, 0xC000 + r,
                     4096, 4096 * 4, "float32", peer))

    for step in range(steps):
        for pipe, (first, second) in enumerate(((0, 2), (1, 3))):
            base = T0 + step * STEP + pipe * 2 * MS
            for m in range(micro):
                t = base + m * 12 * MS
                call(first, "SEND", t, 20_000, 1)                   # activations, eager
                call(second, "RECV", t + 3 * MS, 30_000, 0)          # posted later: data is there
                call(second, "SEND", t + 8 * MS, 20_000, 0)          # gradients back
                call(first, "RECV", t + 5 * MS, 3 * MS + 40_000, 1)  # waits for them
    return _trace(rows)


def test_communicators_that_only_send_and_receive_get_members_and_ranks_from_their_peers():
    c, warnings = load(_pipeline())
    assert sorted(map(tuple, c.comm_members.values())) == [(0, 2), (1, 3)], warnings
    assert sum("recovered from send/receive pairs" in w for w in warnings) == 2, warnings
    # the peers, as global ranks: stage 0 sends to its own stage 1, never the other pipeline's
    from ingero.analysis.calls import _SEND
    send = c.op == _SEND
    assert {(int(a), int(b)) for a, b in zip(c.rank[send], c.peer[send])} == {(0, 2), (2, 0), (1, 3), (3, 1)}
    ev = events(c)
    assert ev.unpaired == 0, ev.unpaired
    assert ev.p2p_pairs == 2 * (2 * 20 * 4) - 2 * 2 - 2 * 1   # less what ranks 2 and 3 missed


def test_sends_pair_with_receives_in_order_even_when_receivers_wake_late():
    # receives return up to 15 ms after their data came, against 2 ms between the pipelines
    # and 12 ms between microbatches: nearest in time no longer agrees on which receive is
    # a send's (recovered nothing); in order (first in, first out) its own receives never
    # end before it was sent, and the tighter direction of each pair names it
    c, warnings = load(_pipeline(woken_late_ms=15))
    assert sorted(map(tuple, c.comm_members.values())) == [(0, 2), (1, 3)], warnings
    assert events(c).unpaired == 0


def test_a_late_attached_trace_whose_calls_match_nobody_cannot_be_judged_and_says_why():
    rep = analyse(_job(ranks=(0,), missed=(0, 0, 0, 0)))
    assert rep.verdict == "cannot-judge"
    assert rep.cannot_judge == ("none of the 120 NCCL calls can be placed: 120 on communicators created before "
                                "the probes attached that no other rank's calls matched"), rep.cannot_judge
    assert any("matched no other rank's calls and were left out (ranks 0)" in w for w in rep.warnings), rep.warnings


def test_one_receive_ending_a_little_before_its_send_does_not_shift_the_pairing():
    from ingero.analysis.recover import _trim

    # a receive one call ahead (the trace began inside the pair's exchange), partners end
    # 0.1 ms after their sends, and one receive's end is 30 us before its send's start
    # (clock noise): the shift is one receive, not none
    sends = np.arange(100) * 20 * MS
    recv_ends = np.r_[-10 * MS, sends + 100_000]
    recv_ends[50] = sends[49] - 30_000
    t = np.r_[sends, recv_ends].astype(np.int64)
    d = np.zeros(len(t), np.int64)
    cut = np.zeros(len(t), bool)
    _trim(np.arange(100), np.arange(100, 201), t, d, cut)
    assert np.flatnonzero(cut).tolist() == [100]


def _in_step(steps=40, seed=3):
    """Two 2-rank communicators in step, as a pipeline's embedding pairs (0, 2) and (1, 3):
    the last stage (ranks 2, 3) arrives early and waits; the first stage arrives 30-36 ms
    later, each at its own moment, and is woken late (0-8 ms, a busy machine), so a waiting
    rank's call ends closer to the other waiting rank's than to its partner's."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        base = T0 + step * STEP
        arrive = {r: base + 30 * MS + int(rng.integers(0, 6 * MS)) for r in (0, 1)}
        for first, last in ((0, 2), (1, 3)):
            a = arrive[first]
            span = {last: (base + int(rng.integers(0, MS)), a + 100_000),
                    first: (a, a + 100_000 + int(rng.integers(0, 8 * MS)))}
            for r, (t, e) in span.items():
                rows.append((len(rows) + 1, f"n{r // 2}", 100 + r, r, -1, -1, 0, step, t, e - t, "ALL_REDUCE",
                             0xE000 + r, 4096, 4096 * 4, "float32", -1))
    return _trace(rows)


def test_a_handle_whose_calls_overlap_only_its_partners_is_grouped_with_them_not_the_tightest():
    c, warnings = load(_in_step())
    # the waiting ranks 2 and 3 end closest together, but rank 0's calls overlap only rank
    # 2's (and rank 1's only rank 3's): that decides, and is sure
    assert sorted(map(tuple, c.comm_members.values())) == [(0, 2), (1, 3)], warnings
    assert sum("confidence 1.00" in w for w in warnings) == 2, warnings
