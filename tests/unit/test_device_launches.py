"""Device times of grouped and coalesced operations: one kernel, one sync event.

On a GPU the send and recv of one ncclGroupStart/End (PyTorch's batch_isend_irecv) and
coalesced collectives run in one kernel, and NCCL stamps every operation of it with the
kernel's interval. The plugin records the launch (its Group event) per operation
(nccl_profiler_events.group_id); the analysis makes each launch one sync event.

The traces here are written as NCCL's plugin reports such a job: per rank, a kernel starts
when its stream reaches it (the rank's own arrival) and ends when the last member of every
operation in it has arrived, plus the transfer. Replaying the measured own work and
transfers must give the measured steps back, and meet no cycle. The same trace without
group numbers (each operation on its own, as before the plugin recorded them) is the
control: grouped exchanges then form cycles and coalesced ones inflate the step.

Each process group has its own stream, and kernels of different streams overlap: an
event follows its stream's previous one and, for its own work, the latest end among its
rank's events that had ended when it started. Replaying a job whose collectives run side
by side gives its steps back; read as one sequence per rank, the overlap becomes waiting.
"""

from __future__ import annotations

import random
from pathlib import Path

import duckdb
import numpy as np
import pytest

from bench.synthetic import pipeline_session
from ingero import schema
from ingero.analysis import analyse_with_replays
from ingero.analysis.calls import _stream_order, device_timing, events, load
from ingero.analysis.replay import measure, replay
from ingero.readonly_sql import open_source

MS = 1_000_000
FIXTURES = Path(__file__).parent / "fixtures"
COLS = ("event_id", "node", "pid", "global_rank", "rank", "nranks", "comm_hash", "seq", "op", "peer",
        "device_start_ns", "device_end_ns", "unfinished", "group_id", "stream", "timestamp_ns")


class Trace:
    """Device rows of a job, kernel by kernel."""

    def __init__(self, ranks: int, seed: int = 3):
        self.rows: list[tuple] = []
        self.at = [0] * ranks                   # each rank's device stream: free from
        self.groups = [0] * ranks
        self.seq: dict = {}
        self.rnd = random.Random(seed)

    def compute(self, r: int, ms: float) -> None:
        self.at[r] += int(ms * MS * (1 + 0.05 * self.rnd.random()))

    def kernel(self, members: dict, xfer_ms: float, comm: int, grouped: bool = True) -> None:
        """One launch per rank in `members` ({rank: [(op, comm rank of peer or -1, comm rank)]}),
        all on `comm`: each rank's kernel starts at its arrival and ends when every member
        has arrived, plus the transfer."""
        end = max(self.at[r] for r in members) + int(xfer_ms * MS)
        for r, ops in members.items():
            self.groups[r] += 1
            for op, peer, crank in ops:
                key = (r, comm, op, peer if op in ("SEND", "RECV") else -1)
                seq = self.seq.get(key, 0)
                self.seq[key] = seq + 1
                self.rows.append((len(self.rows) + 1, f"node-{r // 2}", 1000 + r, r, crank, len(members),
                                  comm, seq, op, peer if peer >= 0 else None, self.at[r], end, False,
                                  self.groups[r] if grouped else None, 0x7000 + comm, self.at[r] - 20_000))
            self.at[r] = end

    def db(self) -> duckdb.DuckDBPyConnection:
        con = duckdb.connect()
        schema.create_all(con)
        con.executemany(f"INSERT INTO nccl_profiler_events ({', '.join(COLS)}) VALUES "
                        f"({', '.join('?' * len(COLS))})", self.rows)
        return con


def pipeline(steps: int = 6, micro: int = 4, grouped: bool = True) -> Trace:
    """pp=2 x dp=2 (rank = 2 * replica + stage): per micro-batch both stages compute, then
    exchange activations and gradients in one group (SEND then RECV on both sides, as
    Megatron's batched exchange of 1F1B's steady state lists them); per step each stage's
    data-parallel pair reduce-scatters and all-gathers its gradients in one coalesced
    launch. Stage 1 computes 1.5x as long as stage 0."""
    tr = Trace(4)
    for _ in range(steps):
        for _ in range(micro):
            for r in range(4):
                tr.compute(r, 2.0 * (1.5 if r % 2 else 1.0))
            for d in range(2):
                tr.kernel({2 * d: [("SEND", 1, 0), ("RECV", 1, 0)], 2 * d + 1: [("SEND", 0, 1), ("RECV", 0, 1)]},
                          0.4, comm=0x100 + d, grouped=grouped)
        for p in range(2):
            tr.kernel({p: [("REDUCE_SCATTER", -1, 0), ("ALL_GATHER", -1, 0)],
                       2 + p: [("REDUCE_SCATTER", -1, 1), ("ALL_GATHER", -1, 1)]}, 0.8, comm=0x200 + p,
                      grouped=grouped)
    return tr


def replayed_steps(con) -> tuple[int, float]:
    """(stuck rounds, largest error of a replayed step against the measured one, as a
    share of the step), with each rank's steps measured between its coalesced launches."""
    c, _ = load(con, device=True)
    ev = events(c)
    m = measure(ev)
    rp = replay(ev, m.w, m.x)
    worst = 0.0
    for k, r in enumerate(ev.ranks):
        lo, hi = ev.off[k], ev.off[k + 1]
        coal = np.flatnonzero(ev.inst[lo:hi] >= 0) + lo       # the step-ending collectives:
        coal = coal[np.r_[ev.e[coal][1:] != ev.e[coal][:-1], True]]   # the last of a kernel's
        meas, got = np.diff(ev.e[coal]), np.diff(rp.e[coal])
        worst = max(worst, float(np.max(np.abs(got - meas) / meas)))
    return rp.stuck_rounds, worst


def test_a_grouped_exchange_and_a_coalesced_launch_are_one_sync_event_each():
    c, _ = load(pipeline(steps=2).db(), device=True)
    ev = events(c)
    # per rank and step: 4 grouped exchanges and 1 coalesced launch, not 10 operations
    assert [int((ev.rank == r).sum()) for r in range(4)] == [10] * 4
    assert ev.p2p_pairs == 2 * 2 * 4 * 2 and ev.unpaired == 0
    # the coalesced launch's two collectives are one instance of both data-parallel members
    has = ev.inst >= 0
    assert has.sum() == 2 * 2 * 2 and np.bincount(ev.inst[has]).max() == 2


def test_replaying_grouped_and_coalesced_launches_meets_no_cycle_and_gives_the_steps_back():
    stuck, err = replayed_steps(pipeline().db())
    assert stuck == 0
    assert err < 0.02


def test_without_launch_numbers_the_same_trace_meets_cycles_and_misses_the_step():
    stuck, err = replayed_steps(pipeline(grouped=False).db())
    assert stuck > 0 and err >= 0.02


def test_a_coalesced_launch_alone_replays_to_the_measured_step():
    def fsdp(grouped):
        tr = Trace(4, seed=5)
        for _ in range(8):
            for r in range(4):
                tr.compute(r, 3.0 if r != 2 else 3.6)
            tr.kernel({r: [("ALL_GATHER", -1, r), ("REDUCE_SCATTER", -1, r)] for r in range(4)}, 1.0,
                      comm=0x300, grouped=grouped)
        return tr.db()

    assert replayed_steps(fsdp(True)) == (0, 0.0)
    stuck, err = replayed_steps(fsdp(False))
    assert err > 0.1          # each collective its own event: the shared interval counted twice


def host_calls(con) -> None:
    """A host call (nccl_events) per device row, at the row's launch, in the same process."""
    con.execute("INSERT INTO nccl_events (event_id, node, pid, global_rank, rank, op, ret, timestamp_ns, "
                "duration_ns, comm_id_hash, seq) SELECT event_id, node, pid, global_rank, rank, op, 0, timestamp_ns, "
                "20000, comm_hash, seq FROM nccl_profiler_events")


def with_host_calls(tr: Trace, extra: list[tuple] = ()) -> duckdb.DuckDBPyConnection:
    """`tr`'s database with a host call (nccl_events) per device row, at the row's launch, in
    the same process; and `extra` host calls: (rank, op, timestamp_ns)."""
    con = tr.db()
    host_calls(con)
    con.executemany("INSERT INTO nccl_events (event_id, node, pid, global_rank, rank, op, ret, timestamp_ns, "
                    "duration_ns, comm_id_hash, seq) VALUES (?, ?, ?, ?, 0, ?, 0, ?, 20000, 2457, ?)",
                    [(len(tr.rows) + 1 + i, f"node-{r // 2}", 1000 + r, r, op, t, i) for i, (r, op, t) in enumerate(extra)])
    return con


def test_host_calls_with_no_device_row_are_warned_about_per_operation_type_with_counts():
    tr = pipeline(steps=6)
    end = max(r[15] for r in tr.rows)
    # 3 all-reduces of rank 1 mid-trace never reached the plugin (e.g. on symmetric memory); an
    # all-to-all runs as sends and receives there
    extra = [(1, "ALL_REDUCE", end // 2 + i) for i in range(3)] + [(0, "ALL_TO_ALL", end // 2 + i) for i in range(5)]
    con = with_host_calls(tr, extra)
    # nor did 3 steps' reduce-scatters of every rank: their host calls stay
    con.execute("DELETE FROM nccl_profiler_events WHERE op = 'REDUCE_SCATTER' AND seq IN (1, 2, 3)")
    device, why = device_timing(con)
    assert device
    assert why is not None and "REDUCE_SCATTER: 12 of 24" in why and "ALL_REDUCE: 3 of 3" in why, why
    assert "ALL_TO_ALL" not in why and "SEND" not in why and "ALL_GATHER" not in why


def test_a_trace_the_plugin_timed_whole_or_up_to_the_calls_in_flight_has_no_coverage_warning():
    tr = pipeline(steps=4)
    first, end = min(r[15] for r in tr.rows), max(r[15] for r in tr.rows)
    # calls before the plugin's first launch and the last two in flight at the end: not gaps
    extra = [(0, "ALL_REDUCE", first - 1000 * (i + 1)) for i in range(5)] + [(2, "ALL_GATHER", end - i) for i in range(2)]
    assert device_timing(with_host_calls(tr, extra)) == (True, None)


def test_a_rank_s_operations_keep_their_gpu_order_when_the_clock_conversion_swaps_them():
    """A 10 us broadcast, then a grouped exchange launched 10 us after it: the plugin converts
    each with the clock fit of the moment it finished, and a fit that moved by 30 us puts the
    exchange first on the host clock. Read in host order the rank would wait in the exchange
    for peers that wait for its broadcast (a cycle); in the GPU's own order it does not."""
    tr = Trace(2)
    for _ in range(4):
        for r in range(2):
            tr.compute(r, 1.0)
        tr.kernel({0: [("BROADCAST", -1, 0)], 1: [("BROADCAST", -1, 1)]}, 0.01, comm=0x400)
        for r in range(2):
            tr.compute(r, 0.01)
        tr.kernel({0: [("SEND", 1, 0), ("RECV", 1, 0)], 1: [("SEND", 0, 1), ("RECV", 0, 1)]}, 0.2, comm=0x500)
    con = tr.db()
    con.execute("UPDATE nccl_profiler_events SET device_start_raw = device_start_ns + 1000000000, "
                "device_end_raw = device_end_ns + 1000000000")
    # rank 0's exchanges: converted 30 us early, before the broadcast they followed
    con.execute("UPDATE nccl_profiler_events SET device_start_ns = device_start_ns - 30000, "
                "device_end_ns = device_end_ns - 30000 WHERE global_rank = 0 AND op IN ('SEND', 'RECV')")
    c, _ = load(con, device=True)
    ev = events(c)
    r0 = c.op[c.rank == 0][:3].tolist()
    assert r0[0] == 4 and set(r0[1:]) == {9, 10}        # BROADCAST, then the exchange
    m = measure(ev)
    assert replay(ev, m.w, m.x).stuck_rounds == 0


def test_an_event_follows_the_last_ended_event_of_each_stream_of_its_rank():
    """Streams A and B of one rank, and a rank with one stream: A1 [0, 10], B1 [5, 20]
    (started while A1 ran: it follows nothing), A2 [12, 15] (B1 still running: A1 only),
    A3 [25, 30] (A2 and B1: both ended, neither started after the other ended), B2 [31, 40]
    (A3 only, though its stream's previous event is B1: A3 started after B1 ended, so it
    already waited for it)."""
    rank = np.array([0, 0, 0, 0, 0, 1, 1])
    a = np.array([0, 5, 12, 25, 31, 0, 10])
    e = np.array([10, 20, 15, 30, 40, 8, 12])
    stream = np.array([1, 2, 1, 1, 2, 1, 1])
    ptr, idx = _stream_order(rank, a, e, stream)
    assert [idx[ptr[i]:ptr[i + 1]].tolist() for i in range(7)] == [[], [], [0], [1, 2], [3], [], [5]]
    assert _stream_order(rank, a, e, np.ones(7, np.int64)) == (None, None)     # one stream per rank


# Megatron's 1F1B with the step's data-parallel reduce-scatter and embedding all-reduce issued
# asynchronously, side by side on their process groups' streams; HSDP with each layer's replicate
# all-reduce beside the next layer's backward. (tp, pp, dp), shape
CONCURRENT = {"1f1b": ((2, 2, 2), dict(schedule="1f1b", world=False, dist_opt=True, embedding=True,
                                       x_kind={"dp": 4.0, "emb": 3.0})),
              "hsdp": ((1, 1, 8), dict(fsdp=4, replicas=2, world=False, x_kind={"rep": 3.0}))}


@pytest.mark.parametrize("shape", CONCURRENT)
def test_concurrent_streams_replay_to_the_measured_step_and_one_sequence_per_rank_does_not(tmp_path, shape):
    layout, kw = CONCURRENT[shape]
    pipeline_session(tmp_path, *layout, nodes=2, steps=12, fault="clean", gpu="plugin", streams=True, **kw)
    _, d = analyse_with_replays(open_source(tmp_path))
    tl = d.timeline
    ev = tl.ev
    measured = tl.step_ns(ev.e)
    m = measure(ev)
    got = replay(ev, m.w, m.x)
    assert got.stuck_rounds == 0
    assert tl.step_ns(got.e) == pytest.approx(measured, rel=0.02)
    ev.prev_ptr = ev.prev_idx = ev.schedule = None   # each rank's events one sequence, as on one stream
    m = measure(ev)
    one = replay(ev, m.w, m.x)
    assert tl.step_ns(one.e) > 1.04 * measured       # the overlap counted as waiting: 5.9% and 16% here


def test_a_kept_lab_trace_on_concurrent_streams_replays_to_its_step_and_keeps_its_verdict():
    """The lab's 3D job (tp=2, pp=2, dp=2, 1F1B, --device gpu --profiler, 40 steps, rank 1 slow):
    its device rows as the plugin recorded them (fixtures/lab-3d-gpu), a host call at each launch.
    Each step's reduce-scatter and embedding all-reduce ran side by side on their streams."""
    con = duckdb.connect()
    schema.create_all(con)
    for t in ("nccl_profiler_events", "ranks"):
        src = FIXTURES / "lab-3d-gpu" / f"{t}.parquet"
        con.execute(f"INSERT INTO {t} BY NAME SELECT * FROM read_parquet('{src}')")
    host_calls(con)
    rep, d = analyse_with_replays(con)
    s = rep.straggler
    assert rep.timing == "device" and (s.kind, s.rank, s.cause) == ("rank", 1, "compute/unknown"), s
    tl = d.timeline
    ev = tl.ev
    measured = tl.step_ns(ev.e)
    assert (np.diff(ev.prev_ptr) > 1).sum() > 100            # events that follow two streams' ends
    m = measure(ev)
    got = replay(ev, m.w, m.x)
    assert got.stuck_rounds == 0 and tl.step_ns(got.e) == pytest.approx(measured, rel=0.02)
    ev.prev_ptr = ev.prev_idx = ev.schedule = None
    m = measure(ev)
    one = replay(ev, m.w, m.x)                               # one sequence per rank: 23% long, 9 cycles
    assert one.stuck_rounds > 0 and tl.step_ns(one.e) > 1.1 * measured


def test_an_all_to_all_s_sends_and_receives_are_one_sync_event_that_replays_without_cycles():
    """NCCL 2.28+ runs an all-to-all as one send and one receive per peer in one kernel: per
    rank one launch, whose pairs with every peer are its dependencies."""
    tr = Trace(4, seed=7)
    for _ in range(6):
        for r in range(4):
            tr.compute(r, 2.0 if r != 3 else 2.8)
        tr.kernel({r: [(op, p, r) for p in range(4) if p != r for op in ("SEND", "RECV")] for r in range(4)},
                  0.5, comm=0x600)
    c, _ = load(tr.db(), device=True)
    ev = events(c)
    assert [int((ev.rank == r).sum()) for r in range(4)] == [6] * 4
    assert ev.p2p_pairs == 6 * 12 and ev.unpaired == 0
    m = measure(ev)
    got = replay(ev, m.w, m.x)
    assert got.stuck_rounds == 0 and got.e.tolist() == ev.e.tolist()
