"""ingero.analysis.hang on hand-built traces: every way a hang is found, named or ruled out."""

from __future__ import annotations

import duckdb
import pytest

from ingero import schema
from ingero.analysis import analyse
from ingero.analysis.hang import HANG_MIN_S, _doing, find_hang

S = 1_000_000_000
T0 = 1_800_000_000 * S
COMM = 0xAB12CD0011223344
NODE_OF = {0: "a", 1: "a", 2: "b", 3: "b"}


def trace(steps: int = 20, world: int = 4, step_ms: int = 50, call_ms: int = 5, skip=()):
    """A DuckDB trace of `world` ranks doing `steps` ALL_REDUCEs on COMM (seq 0..steps-1),
    one every `step_ms`; ranks in `skip` are left out of the ranks table and calls."""
    con = duckdb.connect()
    schema.create_all(con)
    for r in range(world):
        if r in skip:
            continue
        con.execute("INSERT INTO ranks (node, pid, rank) VALUES (?, ?, ?)", [NODE_OF[r], 100 + r, r])
        for s in range(steps):
            call(con, r, s, T0 + s * step_ms * 1_000_000, call_ms * 1_000_000, nranks=world)
    return con


_EID = iter(range(1, 1 << 30))


def call(con, rank, seq, t, d, ret=0, op="ALL_REDUCE", nranks=4, comm=COMM):
    con.execute("""INSERT INTO nccl_events (event_id, node, pid, tid, global_rank, rank, nranks, op,
                   comm_id_hash, seq, timestamp_ns, duration_ns, ret)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                [next(_EID), NODE_OF[rank], 100 + rank, 100 + rank, rank, rank, nranks, op, comm, seq, t, d, ret])


def inflight(con, rank, state, seen, op=None, seq=None, since=None, tid=None, comm=COMM):
    con.execute("""INSERT INTO nccl_inflight (node, pid, tid, rank, seen_ns, state, op, comm_id_hash, seq,
                   comm_rank, nranks, since_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                [NODE_OF[rank], 100 + rank, tid or 100 + rank, rank, seen, state, op,
                 comm if op else None, seq, rank if op else None, 4 if op else None, since])


END = T0 + 20 * 50_000_000     # after the 20 healthy steps


def test_a_healthy_trace_has_no_hang():
    con = trace()
    for r in range(4):
        inflight(con, r, "S", END)
    assert find_hang(con) is None
    assert analyse(con).verdict != "hang"


def test_ranks_waiting_for_a_stopped_rank_that_never_entered_name_it():
    con = trace()
    for r in (0, 1, 3):
        inflight(con, r, "S", END + 41 * S, op="ALL_REDUCE", seq=20, since=END + S)
        inflight(con, r, "S", END + 41 * S, tid=200 + r)          # a second, idle thread
    inflight(con, 2, "T", END + 41 * S)
    inflight(con, 2, "T", END + 41 * S, tid=202)
    h = find_hang(con)
    assert h.missing == [2]
    assert [w["rank"] for w in h.waiting] == [0, 1, 3]
    assert (h.op, h.seq, h.comm, round(h.waited_s)) == ("ALL_REDUCE", 20, f"{COMM:016x}", 40)
    assert h.evidence == (f"ranks 0, 1, 3 wait in ALL_REDUCE #20 of communicator {COMM:016x} for 40 s; "
                          "rank 2 never entered it (its last call ended 41 s ago; its threads are stopped)")
    r = analyse(con)
    assert r.verdict == "hang" and r.to_dict()["hang"]["missing"] == [2]


def test_a_rank_whose_threads_were_last_seen_before_the_others_waited_is_not_named_yet():
    # a live status reads each node's snapshot as it arrives: rank 2's last one is older than
    # the call the others wait in, so whether it entered that call is not known yet
    con = trace()
    for r in (0, 1, 3):
        inflight(con, r, "S", END + 12 * S, op="ALL_REDUCE", seq=20, since=END + S)
    inflight(con, 2, "S", END)
    assert find_hang(con) is None
    con.execute("UPDATE nccl_inflight SET seen_ns = ? WHERE rank = 2", [END + 12 * S])
    assert find_hang(con).missing == [2]


def test_a_rank_stopped_inside_the_call_while_the_others_gave_up_is_named():
    con = trace()
    for r in (0, 1, 3):
        call(con, r, 20, END + S, 20 * S, ret=6)                  # ncclRemoteError at the timeout
    inflight(con, 2, "T", END + 24 * S, op="ALL_REDUCE", seq=20, since=END + S)
    h = find_hang(con)
    assert h.missing == [2] and [w["rank"] for w in h.waiting] == [0, 1, 3]
    assert all(w["ret"] == 6 for w in h.waiting)
    assert "ranks 0, 1, 3 wait in ALL_REDUCE #20" in h.evidence
    assert "gave up with an NCCL error" in h.evidence
    assert "rank 2 entered it 23 s ago and its threads are stopped" in h.evidence


def test_a_rank_stopped_for_a_while_and_continued_is_no_hang():
    con = trace()
    for r in range(4):     # everyone waited 15 s in #20, then it completed
        call(con, r, 20, END + S, 15 * S)
        inflight(con, r, "S", END + 30 * S)
    assert find_hang(con) is None


def test_an_open_call_that_later_returned_is_no_wait():
    con = trace()
    for r in range(4):     # seen in flight 14 s in, then returned fine
        inflight(con, r, "S", END + 15 * S, op="ALL_REDUCE", seq=20, since=END + S)
        call(con, r, 20, END + S, 15 * S)
    assert find_hang(con) is None


def test_a_wait_under_the_minimum_is_no_hang():
    con = trace()
    for r in (0, 1, 3):
        inflight(con, r, "S", END + S + int((HANG_MIN_S - 1) * S), op="ALL_REDUCE", seq=20, since=END + S)
    inflight(con, 2, "T", END + 10 * S)
    assert find_hang(con) is None


def test_a_shorter_minimum_finds_a_hang_sooner():
    con = trace()
    for r in (0, 1, 3):
        inflight(con, r, "S", END + 7 * S, op="ALL_REDUCE", seq=20, since=END + S)
    inflight(con, 2, "T", END + 7 * S)
    assert find_hang(con) is None
    assert find_hang(con, min_s=5).missing == [2]


def test_a_wait_not_far_beyond_the_ranks_usual_call_is_no_hang():
    con = trace(call_ms=1000, step_ms=1100)     # collectives of 1 s: 12 s is not 20x that
    end = T0 + 20 * 1_100_000_000
    for r in (0, 1, 3):
        inflight(con, r, "S", end + 13 * S, op="ALL_REDUCE", seq=20, since=end + S)
    assert find_hang(con) is None


def test_every_rank_inside_and_none_stopped_is_a_hang_with_nobody_missing():
    con = trace()
    for r in range(4):
        inflight(con, r, "S", END + 31 * S, op="ALL_REDUCE", seq=20, since=END + S)
    h = find_hang(con)
    assert h.missing == [] and len(h.waiting) == 4
    assert "every traced member entered it or waits elsewhere, and none is stopped" in h.evidence


def test_a_member_that_finished_the_call_and_an_untraced_member_are_said():
    con = trace(skip=(3,))
    call(con, 2, 20, END + S, 2_000_000)               # a root that finished early
    for r in (0, 1):
        inflight(con, r, "S", END + 31 * S, op="ALL_REDUCE", seq=20, since=END + S)
    h = find_hang(con)
    assert h.missing == []
    assert "rank 2 finished it and went on" in h.evidence
    assert "1 member of the communicator was not traced" in h.evidence


def test_the_instance_most_ranks_wait_in_is_the_hang():
    con = trace()
    other = 0x5555
    inflight(con, 0, "S", END + 60 * S, op="ALL_GATHER", seq=3, since=END, comm=other, tid=300)
    for r in (1, 2):
        inflight(con, r, "S", END + 31 * S, op="ALL_REDUCE", seq=20, since=END + S)
    h = find_hang(con)
    assert (h.op, h.seq) == ("ALL_REDUCE", 20)
    assert [w["rank"] for w in h.waiting] == [1, 2]


def test_a_trace_without_calls_in_flight_judges_the_failed_calls():
    con = trace()
    con.execute("DROP TABLE nccl_inflight")
    for r in (0, 1, 3):
        call(con, r, 20, END + S, 20 * S, ret=6)
    h = find_hang(con)
    assert h.missing == [2]
    assert "rank 2 never entered it (its last call ended 21 s ago; its threads were not seen)" in h.evidence


def test_a_rank_that_never_called_is_said():
    con = trace()
    for r in (0, 1, 3):
        call(con, r, 20, END + S, 20 * S, ret=6)
    con.execute("DELETE FROM nccl_events WHERE global_rank = 2")
    con.execute("INSERT INTO nccl_events (event_id, node, pid, global_rank, op, comm_id_hash, ret, "
                "timestamp_ns, duration_ns) VALUES (999999, 'b', 102, 2, 'COMM_INIT_RANK', ?, 0, NULL, NULL)",
                [COMM])
    h = find_hang(con)
    assert h.missing == [2] and "it made no traced call" in h.evidence


def test_a_rank_stopped_inside_a_call_nobody_waits_in_is_no_hang():
    con = trace()
    inflight(con, 2, "T", END + 30 * S, op="ALL_REDUCE", seq=20, since=END + S)
    assert find_hang(con) is None


def test_some_waiters_gave_up_and_some_still_wait():
    con = trace()
    call(con, 0, 20, END + S, 20 * S, ret=6)
    inflight(con, 1, "S", END + 25 * S, op="ALL_REDUCE", seq=20, since=END + S)
    h = find_hang(con)
    assert h.missing == [2, 3] and round(h.waited_s) == 24
    assert "ranks 0, 1 wait in ALL_REDUCE #20" in h.evidence and "(rank 0 gave up with an NCCL error)" in h.evidence


def test_a_rank_waiting_in_a_group_with_the_stopped_rank_is_not_missing():
    # rank 2 stopped inside its send/recv group with ranks 1 and 3; rank 1 and 3 wait in
    # that group, rank 0 went on and waits in the next ALL_REDUCE
    con = trace()
    for r in range(4):
        con.execute("INSERT INTO nccl_events (event_id, node, pid, tid, global_rank, op, comm_id_hash, ret, "
                    "timestamp_ns, duration_ns) VALUES (?, ?, ?, ?, ?, 'GROUP_END', 0, 0, ?, 1000000)",
                    [next(_EID), NODE_OF[r], 100 + r, 100 + r, r, END - S])
    inflight(con, 0, "S", END + 41 * S, op="ALL_REDUCE", seq=20, since=END + S)
    for r in (1, 3):
        inflight(con, r, "S", END + 41 * S, op="GROUP_END", since=END, comm=None)
    inflight(con, 2, "T", END + 41 * S, op="GROUP_END", since=END, comm=None)
    h = find_hang(con)
    assert h.missing == [2] and [w["rank"] for w in h.waiting] == [0]
    assert "rank 2 entered GROUP_END 41 s ago and its threads are stopped" in h.evidence
    assert "rank 1 waits in GROUP_END for 41 s" in h.evidence and "rank 3 waits in GROUP_END" in h.evidence


def test_only_receives_waiting_judge_among_every_rank():
    con = trace()
    inflight(con, 1, "S", END + 30 * S, op="RECV", seq=7, since=END)
    inflight(con, 2, "S", END + 30 * S, op="RECV", seq=3, since=END + S)
    inflight(con, 0, "T", END + 30 * S)
    h = find_hang(con)
    assert (h.op, h.seq, h.comm) == ("RECV", 7, f"{COMM:016x}")
    assert [(w["rank"], w["seq"]) for w in h.waiting] == [(1, 7), (2, 3)] and h.missing == [0, 3]
    assert "rank 0 waits in no call" in h.evidence and "its threads are stopped" in h.evidence
    assert f"ranks 1, 2 wait in RECV on communicator {COMM:016x} for 30 s" in h.evidence


def test_the_instance_that_shows_the_cause_wins_over_a_longer_wait_on_a_waiter():
    # 3D-like: rank 1 waits (longest) on rank 3, which itself waits in a receive; rank 0
    # waits on rank 2, which is stopped: the cause is seen through rank 0's wait
    con = trace()
    x, y = 0x1111, 0x2222
    for r, comm in ((1, x), (3, x), (0, y), (2, y)):
        call(con, r, 0, T0, 1_000_000, op="REDUCE_SCATTER", comm=comm, nranks=2)
    inflight(con, 1, "S", END + 32 * S, op="REDUCE_SCATTER", seq=1, since=END, comm=x)
    inflight(con, 3, "S", END + 32 * S, op="RECV", seq=9, since=END + S)
    inflight(con, 0, "S", END + 31 * S, op="REDUCE_SCATTER", seq=1, since=END, comm=y)
    inflight(con, 2, "T", END + 31 * S)
    h = find_hang(con)
    assert h.comm == f"{y:016x}" and h.missing == [2] and [w["rank"] for w in h.waiting] == [0]
    assert "ranks 1, 3 also wait, in RECV, REDUCE_SCATTER" in h.evidence


def _quiet(con, seen_after_s: float, stopped=(2,)):
    """Every rank's threads seen `seen_after_s` after the last calls (END), `stopped` ones stopped."""
    for r in range(4):
        inflight(con, r, "T" if r in stopped else "S", END + int(seen_after_s * S))


def test_a_job_standing_still_around_a_stopped_rank_is_a_hang_without_a_call_in_flight():
    # a GPU: the others queued their collectives and wait in the stream synchronisation
    con = trace()
    _quiet(con, 20)
    h = find_hang(con)
    assert h.missing == [2] and h.op is None and [w["rank"] for w in h.waiting] == [0, 1, 3]
    assert h.evidence.startswith("no rank made an NCCL call for 20 s before its threads were last seen")
    assert "rank 2: its threads are stopped; rank 0: its threads sleep outside NCCL" in h.evidence


PCOMM = 0x5EED00C0FFEE0001      # NCCL's own hash of COMM (the profiler plugin's)


def device_open(con, rank, seen, op=None, seq=None, dev_start=None, slot=0, comm=PCOMM):
    """A row of nccl_device_inflight: an operation of `rank` the plugin holds open (op None: the
    communicator, with nothing open)."""
    con.execute("""INSERT INTO nccl_device_inflight (node, pid, rank, seen_ns, comm_hash, comm_rank, nranks,
                   slot, op, seq, nchannels, channels_started, channels_stopped, launched_ns, enqueued,
                   device_start_ns) VALUES (?, ?, ?, ?, ?, ?, 4, ?, ?, ?, 2, ?, 0, ?, true, ?)""",
                [NODE_OF[rank], 100 + rank, rank, seen, comm, rank, slot if op else None, op, seq,
                 2 if dev_start else 0, dev_start - 1_000_000 if dev_start else None, dev_start])


def device_done(con, rank, seq, t, d, comm=PCOMM):
    con.execute("""INSERT INTO nccl_profiler_events (event_id, node, pid, global_rank, op, nranks, comm_hash, seq,
                   timestamp_ns, device_start_ns, device_end_ns, device_duration_ns, unfinished)
                   VALUES (?, ?, ?, ?, 'ALL_REDUCE', 4, ?, ?, ?, ?, ?, ?, false)""",
                [next(_EID), NODE_OF[rank], 100 + rank, rank, comm, seq, t, t, t + d, d])


def _gpu_hang(con, stopped_inside: bool = False):
    """The GPU-like device: the others' ALL_REDUCE #20 (NCCL's seq) started on their GPUs and never
    finished; their host threads sleep in the stream synchronisation; rank 2 is stopped."""
    for r in range(4):
        for s in range(20):
            device_done(con, r, s, T0 + s * 50_000_000, 4_000_000)
    _quiet(con, 21)
    for r in (0, 1, 3):
        device_open(con, r, END + 21 * S, op="ALL_REDUCE", seq=20, dev_start=END + S)
    device_open(con, 2, END + 21 * S)
    if stopped_inside:
        device_open(con, 2, END + 21 * S, op="ALL_REDUCE", seq=20, dev_start=END + S // 2, slot=3)


def test_a_collective_the_gpus_started_and_never_finished_is_named_with_the_rank_that_never_entered():
    con = trace()
    _gpu_hang(con)
    h = find_hang(con)
    assert h.missing == [2] and [w["rank"] for w in h.waiting] == [0, 1, 3]
    assert (h.op, h.seq, h.comm, round(h.waited_s)) == ("ALL_REDUCE", 20, f"{PCOMM:016x}", 20)
    assert h.evidence == (f"ranks 0, 1, 3 wait in ALL_REDUCE #20 of communicator {PCOMM:016x} on the device for "
                          "at least 20 s (the GPU started it and never finished it; the host waits outside "
                          "NCCL); rank 2 never entered it (its last call ended 21 s ago; its threads are stopped)")
    assert analyse(con).verdict == "hang"


def test_with_the_plugin_a_stack_is_no_evidence_and_the_device_names_the_collective():
    # attached after the hang: on their stacks the ranks seem inside ALL_GATHER (return addresses
    # left over from earlier calls; their host threads wait outside NCCL), while the plugin holds
    # the ALL_REDUCE their GPUs started and never finished
    con = trace()
    _gpu_hang(con)
    for r in range(4):
        _on_stack(con, r, "T" if r == 2 else "S", END + 21 * S, "ALL_GATHER", END + S // 4)
    h = find_hang(con)
    assert h.missing == [2] and [w["rank"] for w in h.waiting] == [0, 1, 3]
    assert (h.op, h.seq) == ("ALL_REDUCE", 20), h
    assert "on the device" in h.evidence and "stacks" not in h.evidence, h.evidence
    assert "rank 2 never entered it" in h.evidence, h.evidence


def test_a_rank_stopped_while_its_gpu_ran_the_collective_is_named_inside_it():
    con = trace()
    _gpu_hang(con, stopped_inside=True)
    h = find_hang(con)
    assert h.missing == [2] and [w["rank"] for w in h.waiting] == [0, 1, 3]
    assert "rank 2 entered it 20 s ago and its threads are stopped" in h.evidence


def test_a_rank_stopped_inside_an_operation_its_peer_finished_is_named_by_the_peers_next_one():
    """Rank 2 stopped while its GPU ran ALL_REDUCE #20 on the communicator it shares with rank
    3, after its data had reached rank 3: rank 3's ALL_REDUCE #20 ended, and it waits in
    BROADCAST #20, which rank 2 queued and never started; ranks 0 and 1 wait in their own
    communicator's next ALL_REDUCE. Rank 2's operation is open longest, but only a stopped rank
    is in it (a lab run in CI)."""
    con = trace()
    other = PCOMM + 1
    for r in range(4):
        for s in range(20):
            device_done(con, r, s, T0 + s * 50_000_000, 4_000_000, comm=PCOMM if r >= 2 else other)
    _quiet(con, 21)
    device_done(con, 3, 20, END, 4_000_000)
    device_open(con, 3, END + 21 * S, op="BROADCAST", seq=20, dev_start=END + S)
    device_open(con, 2, END + 21 * S, op="ALL_REDUCE", seq=20, dev_start=END + S // 2)
    device_open(con, 2, END + 21 * S, op="BROADCAST", seq=20, slot=1)
    for r in (0, 1):
        device_open(con, r, END + 21 * S, op="ALL_REDUCE", seq=20, dev_start=END + S, comm=other)
    h = find_hang(con)
    assert h is not None and (h.op, h.seq) == ("BROADCAST", 20), h
    assert h.missing == [2] and [w["rank"] for w in h.waiting] == [3], h
    assert "rank 2 entered ALL_REDUCE #20" in h.evidence and "its threads are stopped" in h.evidence, h.evidence
    assert analyse(con).verdict == "hang"


def test_a_device_operation_open_for_long_on_a_job_whose_collectives_take_that_long_is_no_hang():
    con = trace()
    for r in range(4):
        for s in range(20):     # each took 2 s on the device: 20 s open is not 20x that
            device_done(con, r, s, T0 + s * 50_000_000, 2 * S)
        device_open(con, r, END + 21 * S, op="ALL_REDUCE", seq=20, dev_start=END + S)
    _quiet(con, 21, stopped=())
    assert find_hang(con) is None


@pytest.mark.parametrize("seen_after_s, stopped", [(20, ()), (8, (2,))], ids=["nobody-stopped", "short"])
def test_a_quiet_spell_without_a_stopped_rank_or_too_short_is_no_hang(seen_after_s, stopped):
    con = trace()
    _quiet(con, seen_after_s, stopped)
    assert find_hang(con) is None


def test_a_quiet_spell_is_no_hang_while_a_rank_still_calls_or_the_job_calls_rarely():
    con = trace()
    call(con, 0, 20, END + 15 * S, 1_000_000)
    _quiet(con, 20)
    assert find_hang(con) is None
    con = trace(step_ms=2000)                   # a call every 2 s: 20 s quiet is not 20x that
    end = T0 + 20 * 2 * S
    for r in range(4):
        inflight(con, r, "T" if r == 2 else "S", end + 20 * S)
    assert find_hang(con) is None


@pytest.mark.parametrize("states, words", [
    (None, "were not seen"), (["T", "T"], "are stopped"), (["T", "S"], "are partly stopped"),
    (["S", "R"], "run (on a CPU or waiting for one) outside NCCL"), (["S", "D"], "wait in I/O"),
    (["Z"], "are exiting"), (["S", "S"], "sleep outside NCCL"),
])
def test_thread_states_in_words(states, words):
    assert _doing(states) == words


# ---- a job that hung before the trace began: no call traced at all ----------------------------

def _attached_late(world: int = 4):
    """A trace that began after the job hung: the ranks' processes first seen at T0, no call."""
    con = duckdb.connect()
    schema.create_all(con)
    for r in range(world):
        con.execute("INSERT INTO ranks (node, pid, rank, first_seen_ns) VALUES (?, ?, ?, ?)",
                    [NODE_OF[r], 100 + r, r, T0])
    return con


def _on_stack(con, rank, state, seen, op, since):
    """A thread found inside `op` on its stack: no communicator, seq or rank in it."""
    con.execute("""INSERT INTO nccl_inflight (node, pid, tid, rank, seen_ns, state, op, since_ns)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?)""", [NODE_OF[rank], 100 + rank, 100 + rank, rank, seen, state,
                                                        op, since])


def test_ranks_found_inside_a_collective_on_their_stacks_name_the_rank_outside_any_call():
    con = _attached_late()
    for r in (0, 1, 3):
        _on_stack(con, r, "S", T0 + 14 * S, "ALL_REDUCE", T0 + S)
    inflight(con, 2, "T", T0 + 14 * S)
    rep = analyse(con)
    assert rep.verdict == "hang" and rep.cannot_judge, rep      # hang, though no call can be judged
    h = rep.hang
    assert (h.missing, h.op, h.comm, h.seq) == ([2], "ALL_REDUCE", None, None), h
    assert [w["rank"] for w in h.waiting] == [0, 1, 3] and h.waited_s == 13.0
    assert h.evidence.startswith("ranks 0, 1, 3 wait in ALL_REDUCE for at least 13 s (found inside it on "
                                 "their threads' stacks"), h.evidence
    assert "rank 2 is inside no NCCL call (it made no traced call; its threads are stopped)" in h.evidence


def test_a_rank_found_in_another_call_on_its_stack_waits_elsewhere():
    con = _attached_late()
    for r in (0, 1):
        _on_stack(con, r, "S", T0 + 14 * S, "REDUCE_SCATTER", T0 + S)
    _on_stack(con, 3, "S", T0 + 14 * S, "RECV", T0 + S)
    inflight(con, 2, "T", T0 + 14 * S)
    h = find_hang(con)
    assert (h.missing, h.op) == ([2], "REDUCE_SCATTER"), h
    assert "rank 3 waits in RECV for at least 13 s" in h.evidence, h.evidence


def test_a_rank_stopped_inside_the_collective_found_on_the_stacks_is_named():
    con = _attached_late()
    for r in (0, 1, 3):
        _on_stack(con, r, "S", T0 + 14 * S, "ALL_REDUCE", T0 + S)
    _on_stack(con, 2, "T", T0 + 14 * S, "ALL_REDUCE", T0 + S)
    h = find_hang(con)
    assert h.missing == [2] and h.op == "ALL_REDUCE", h
    assert "rank 2 was inside it when the probes attached and its threads are stopped" in h.evidence


def test_calls_found_on_the_stacks_for_less_than_the_minimum_are_no_hang_yet():
    con = _attached_late()
    for r in (0, 1, 3):
        _on_stack(con, r, "S", T0 + 6 * S, "ALL_REDUCE", T0 + S)
    inflight(con, 2, "T", T0 + 6 * S)
    assert find_hang(con) is None
    assert find_hang(con, 5.0) is not None        # a live status's shorter minimum


def test_a_job_that_made_no_call_since_the_trace_began_stands_still_around_a_stopped_rank():
    # a GPU: the others wait in the stream synchronisation, outside NCCL, since before the trace
    con = _attached_late()
    _quiet(con, 0)
    for r in range(4):
        con.execute("UPDATE nccl_inflight SET seen_ns = ? WHERE rank = ?", [T0 + 12 * S, r])
    h = find_hang(con)
    assert h.missing == [2] and h.op is None, h
    assert h.evidence.startswith("no rank made an NCCL call in the 12 s the job was traced"), h.evidence
    con.execute("UPDATE nccl_inflight SET state = 'S'")
    assert find_hang(con) is None                 # nobody stopped: a quiet spell, no verdict
