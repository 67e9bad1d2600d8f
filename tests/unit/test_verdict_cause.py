"""Which off-CPU wait explains a rank's excess own work (ingero.analysis.verdict._offcpu_cause).

Figures from the 3D lab's io-stall on a saturated 2-core machine (bench.verdict_lab, load
average 15-18): the stalled rank's I/O wait is its own (peers 0) but covers under a third of
its excess own work, while its runqueue wait, grown with the machine's load, covers more.
Judged by the first reason to pass alone it was named cpu-contention in 2 of 3 runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingero.analysis.model import RankRow
from ingero.analysis.verdict import OwnRunq, _offcpu_cause

MS = 1_000_000
TRACED = 6_000 * MS


def _rows(victim: dict, peer_rq=(690, 700, 720, 660, 740, 705, 680)) -> dict:
    rows = {r: RankRow(rank=r, node=None, pod=None, pid=r, offcpu_ms={"runqueue": float(rq), "sleep": 4000.0})
            for r, rq in enumerate(peer_rq, start=1)}
    rows[0] = RankRow(rank=0, node=None, pod=None, pid=0, offcpu_ms=victim)
    return rows


def test_an_io_stalled_rank_whose_runqueue_wait_grew_with_the_load_is_io():
    cause, why = _offcpu_cause(_rows({"io": 400.0, "runqueue": 1300.0}), 0, 1500 * MS, TRACED)
    assert cause == "io", why
    assert "runqueue" in why and "peers" in why, why     # the other signal weighed is named


def test_a_starved_rank_without_io_is_cpu_contention():
    cause, why = _offcpu_cause(_rows({"runqueue": 2500.0}), 0, 1500 * MS, TRACED)
    assert cause == "cpu-contention", why


def test_a_little_io_beside_a_runqueue_wait_that_explains_the_excess_is_cpu_contention():
    # 60 ms of I/O is 4% of the excess: not weighed, whatever its multiple of the peers' 0 ms
    cause, why = _offcpu_cause(_rows({"io": 60.0, "runqueue": 2500.0}), 0, 1500 * MS, TRACED)
    assert cause == "cpu-contention", why


def test_an_io_wait_that_explains_too_little_alone_names_no_cause():
    # neither passes the full test: 27% of the excess in I/O, the runqueue like the peers'
    cause, why = _offcpu_cause(_rows({"io": 400.0, "runqueue": 700.0}), 0, 1500 * MS, TRACED)
    assert cause == "compute/unknown", why


def test_a_slow_rank_that_also_waited_a_little_more_for_a_cpu_is_not_cpu_contention():
    # the GPU-like slow-rank beside a cpu-hog lab and a CI run: its runqueue wait beyond its
    # peers' covered 14-23% of its excess own work (once over 30%); a starved rank's covers
    # more than all of it (lab cpu-hog victims: 225-238%)
    rows = _rows({"runqueue": 465.0 + 0.4 * 810}, peer_rq=(460, 470, 455, 480, 465, 450, 475))
    cause, why = _offcpu_cause(rows, 0, 810 * MS, TRACED)
    assert cause == "compute/unknown", why
    rows = _rows({"runqueue": 465.0 + 2.25 * 810}, peer_rq=(460, 470, 455, 480, 465, 450, 475))
    assert _offcpu_cause(rows, 0, 810 * MS, TRACED)[0] == "cpu-contention"


def _with_waits(rows: dict, waits: dict) -> dict:
    for r, n in waits.items():
        rows[r].offcpu_waits = {"runqueue": n}
    return rows


def test_a_rank_that_waits_more_often_but_not_longer_each_time_is_not_cpu_contention():
    # the GPU-like lossy-link victim (bench figures, 2026-11-25): 2,053 ms of runqueue wait vs a
    # peer median of ~980 ms, but 6.3 ms per wait against its peers' 4.7: woken more often by
    # its retransmit timers, not starved
    rows = _with_waits(_rows({"runqueue": 2053.0}, peer_rq=(928, 981, 1496)), {0: 328, 1: 240, 2: 209, 3: 259})
    cause, why = _offcpu_cause(rows, 0, 1500 * MS, TRACED)
    assert cause == "compute/unknown", why
    # the same total in few long waits (lab cpu-hog victims: 11-255 ms per wait vs peers' 0.5-14)
    rows = _with_waits(_rows({"runqueue": 2053.0}, peer_rq=(928, 981, 1496)), {0: 50, 1: 240, 2: 209, 3: 259})
    assert _offcpu_cause(rows, 0, 1500 * MS, TRACED)[0] == "cpu-contention"


def test_a_starved_rank_whose_peers_are_rarely_preempted_is_cpu_contention():
    # the 3D cpu-hog of a CI run (35f1ef7): the victim 5,600 ms of runqueue wait over 165
    # preemptions and 567 sleeps; its peers 470-994 ms over 21-65 preemptions and ~700 sleeps.
    # Per preemption alone the victim was 1.6x its peers (their waits are wake-up tails after
    # sleeps, which a count of preemptions misses); per off-CPU interval it is 9.7x
    peers = {1: (994, 21, 646), 2: (581, 27, 692), 3: (582, 23, 711), 4: (617, 38, 684), 5: (578, 25, 725),
             6: (470, 31, 692), 7: (501, 65, 686)}
    rows = _rows({"runqueue": 5600.0, "sleep": 2534.0}, peer_rq=[v[0] for v in peers.values()])
    rows[0].offcpu_waits = {"runqueue": 165, "sleep": 567}
    for r, (_, pre, sl) in peers.items():
        rows[r].offcpu_waits = {"runqueue": pre, "sleep": sl}
    cause, why = _offcpu_cause(rows, 0, 85 * 30 * MS, TRACED)
    assert cause == "cpu-contention", why


def _clean_starved_rows() -> dict:
    # the GPU-like clean job beside a cpu-hog lab and a CI run (CI of 058ec6f, 2026-11-25): rank 0
    # (rank 1 there) waited 851 ms in the runqueue against 354-522 ms, 1.7x its peers per off-CPU
    # interval, and worked 9.8 ms/step (196 ms over 20 steps) more than its peers. With 3 peers
    # that total is no outlier (z 3.3 < 3.5)
    rows = _rows({"runqueue": 851.0}, peer_rq=(354, 438, 522))
    return _with_waits(rows, {0: 492, 1: 354, 2: 438, 3: 522})


def _own(share: float, peers_ms: float = 12.0, excess_ms: float = 9.8, steps: int = 20) -> OwnRunq:
    return OwnRunq(mine=(peers_ms + share * excess_ms) * MS, peers=peers_ms * MS, share=share, steps=steps)


def test_a_rank_waiting_for_a_cpu_inside_its_own_work_is_cpu_contention_below_the_per_wait_test():
    rows = _clean_starved_rows()
    # by the kernel's totals alone: more waits, not longer ones, so not cpu-contention
    assert _offcpu_cause(rows, 0, 196 * MS, TRACED)[0] == "compute/unknown"
    # where the waits are says it: inside its own work, twice its excess beyond its peers'
    cause, why = _offcpu_cause(rows, 0, 196 * MS, TRACED, _own(2.1))
    assert cause == "cpu-contention", why
    assert "inside its own work" in why and "1.7x" in why, why


def test_a_slow_rank_whose_own_work_holds_a_little_more_runqueue_wait_is_not_cpu_contention():
    # slow-rank victims of the lab: -0.0-0.29 of their excess own work; the floor is 0.5
    rows = _clean_starved_rows()
    assert _offcpu_cause(rows, 0, 196 * MS, TRACED, _own(0.29))[0] == "compute/unknown"
    assert _offcpu_cause(rows, 0, 196 * MS, TRACED, _own(0.49))[0] == "compute/unknown"


def test_a_wait_inside_own_work_under_the_absolute_floor_is_no_cause():
    # 0.4 ms/step over 20 steps is 8 ms in the session: under the 12 ms floor (10 ms, 0.2% of 6 s)
    rows = _clean_starved_rows()
    assert _offcpu_cause(rows, 0, 8 * MS, TRACED, _own(1.0, excess_ms=0.4))[0] == "compute/unknown"
    assert _offcpu_cause(rows, 0, 16 * MS, TRACED, _own(1.0, excess_ms=0.8))[0] == "cpu-contention"


def test_only_a_rank_starved_at_each_wait_outweighs_a_network_or_spread_verdict():
    from ingero.analysis.verdict import Candidate, _own_offcpu

    def rank0(cause):
        return Candidate("rank", [0], 10 * MS, "rank 0", cause=cause)

    rows = _clean_starved_rows()                      # 1.7x its peers per off-CPU interval
    assert not _own_offcpu(rows, rank0("cpu-contention"))
    assert _own_offcpu(rows, rank0("io"))
    assert not _own_offcpu(rows, rank0("compute/unknown"))
    rows[0].offcpu_waits = {"runqueue": 100}          # the same total in few long waits: 8.5x
    assert _own_offcpu(rows, rank0("cpu-contention"))
    for r in rows.values():                           # no interval counts: the totals' tests decided
        r.offcpu_waits = {}
    assert _own_offcpu(rows, rank0("cpu-contention"))


# Each threshold of the weighing on its figure exactly, with three peers alike (their MAD is 0,
# so a z is the excess over the 12 ms floor of a 6 s session).

def _alike(victim: dict, peers: dict, waits: dict | None = None) -> dict:
    rows = {r: RankRow(rank=r, node=None, pod=None, pid=r, offcpu_ms=dict(peers)) for r in (1, 2, 3)}
    rows[0] = RankRow(rank=0, node=None, pod=None, pid=0, offcpu_ms=victim)
    for r, n in (waits or {}).items():
        rows[r].offcpu_waits = {"runqueue": n}
    return rows


def test_the_evidence_says_both_reasons_weighed_with_their_figures():
    cause, why = _offcpu_cause(_rows({"io": 400.0, "runqueue": 1300.0}), 0, 1500 * MS, TRACED)
    assert (cause, why) == ("io", "it spent 400 ms off-CPU in io wait vs a peer median of 0 ms (z 2.7), 27% of its "
                                  "excess own work; also 1300 ms off-CPU in runqueue wait vs a peer median of 700 ms "
                                  "(1.9x its peers', against 40.0x for io)")
    cause, why = _offcpu_cause(_rows({"io": 400.0, "runqueue": 700.0}), 0, 1500 * MS, TRACED)
    assert (cause, why) == ("compute/unknown", "no CPU or I/O wait of its own explains it (off-CPU times weighed)")
    assert _offcpu_cause(_rows({"io": 400.0}), 9, 1500 * MS, TRACED) == ("compute/unknown", "")   # no row


def test_an_outlier_at_z_3_5_exactly_is_one_on_both_scales():
    rows = _alike({"io": 142.0}, {"io": 100.0})                           # 42 ms over: z 3.5 on the 12 ms floor
    assert _offcpu_cause(rows, 0, 100 * MS, TRACED)[0] == "io"            # 42% of the excess, alone
    assert _offcpu_cause(_alike({"io": 141.9}, {"io": 100.0}), 0, 100 * MS, TRACED)[0] == "compute/unknown"


def test_io_covering_40_percent_of_the_excess_names_io_alone():
    # 60 ms over peers alike: z 5 on the floor, 4 on a tenth of the 150 ms excess
    assert _offcpu_cause(_alike({"io": 160.0}, {"io": 100.0}), 0, 150 * MS, TRACED)[0] == "io"
    # the same with interval counts: io is judged by its totals, not per wait as the runqueue is
    rows = _alike({"io": 160.0}, {"io": 100.0}, waits={0: 10, 1: 10, 2: 10, 3: 10})
    assert _offcpu_cause(rows, 0, 150 * MS, TRACED)[0] == "io"


def test_waits_weighed_together_name_the_cause_at_half_the_excess_exactly():
    # io 25% and runqueue 25% of a 400 ms excess: neither alone, together half of it
    rows = _alike({"io": 100.0, "runqueue": 200.0}, {"runqueue": 100.0})
    assert _offcpu_cause(rows, 0, 400 * MS, TRACED)[0] == "io"            # 10x its peers' floor vs 2x
    assert _offcpu_cause(rows, 0, 401 * MS, TRACED)[0] == "compute/unknown"


def test_a_wait_covering_15_percent_of_the_excess_exactly_is_weighed():
    # io: 45 ms of a 300 ms excess (15%, z 3.75, not alone), runqueue 37.5%: together over half
    rows = _alike({"io": 45.0, "runqueue": 212.5}, {"runqueue": 100.0})
    assert _offcpu_cause(rows, 0, 300 * MS, TRACED)[0] == "io"
    rows = _alike({"io": 44.9, "runqueue": 212.5}, {"runqueue": 100.0})
    assert _offcpu_cause(rows, 0, 300 * MS, TRACED)[0] == "compute/unknown"


def test_a_rank_waiting_4x_its_peers_per_wait_exactly_is_judged_by_its_totals():
    # 40 ms a wait against 10: starved, so its 300 ms over the peers (60% of the excess) names it
    rows = _alike({"runqueue": 400.0}, {"runqueue": 100.0}, waits={0: 10, 1: 10, 2: 10, 3: 10})
    assert _offcpu_cause(rows, 0, 500 * MS, TRACED)[0] == "cpu-contention"
    rows = _alike({"runqueue": 399.0}, {"runqueue": 100.0}, waits={0: 10, 1: 10, 2: 10, 3: 10})
    assert _offcpu_cause(rows, 0, 500 * MS, TRACED)[0] == "compute/unknown"     # 3.99x: more waits only


def test_a_wait_inside_own_work_at_the_absolute_floor_exactly_names_it():
    rows = _clean_starved_rows()
    at = OwnRunq(mine=12_600_000, peers=12_000_000, share=2.1, steps=20)       # 0.6 ms x 20 = the 12 ms floor
    assert _offcpu_cause(rows, 0, 196 * MS, TRACED, at)[0] == "cpu-contention"
    assert _offcpu_cause(rows, 0, 196 * MS, TRACED, at._replace(mine=12_599_999))[0] == "compute/unknown"


def test_a_wait_inside_own_work_is_weighed_beside_an_io_wait():
    # runqueue inside its own work (1.9x its peers' total) against io 1.9x its peers': the larger
    # multiple is the cause, the other is said
    rows = _with_waits(_rows({"runqueue": 851.0, "io": 93.0}, peer_rq=(354, 438, 522)),
                       {0: 492, 1: 354, 2: 438, 3: 522})
    for r in (1, 2, 3):
        rows[r].offcpu_ms["io"] = 50.0
    cause, why = _offcpu_cause(rows, 0, 196 * MS, TRACED, _own(2.1))
    assert cause == "cpu-contention"
    assert why.endswith("; also 93 ms off-CPU in io wait vs a peer median of 50 ms (1.9x its peers', against "
                        "1.9x for runqueue)"), why
    # io the larger multiple (3.5x) but not alone: the runqueue inside its own work makes up the rest
    for r in (1, 2, 3):
        rows[r].offcpu_ms["io"] = 20.0
    rows[0].offcpu_ms["io"] = 70.0
    cause, why = _offcpu_cause(rows, 0, 196 * MS, TRACED, _own(2.1))
    assert cause == "io" and "against 3.5x for io" in why, why


def _lab_fixture(name: str):
    """A real lab run kept as Parquet under fixtures/`name`, loaded and judged."""
    import duckdb

    from ingero import schema
    from ingero.analysis import analyse

    con = duckdb.connect()
    schema.create_all(con)
    for p in sorted((Path(__file__).parent / "fixtures" / name).glob("*.parquet")):
        con.execute(f"INSERT INTO {p.stem} BY NAME SELECT * FROM read_parquet('{p}')")
    return con, analyse(con)


def test_a_lab_slow_stage_on_a_busy_machine_is_named_that_stage():
    """A real run (fixtures/lab-gpu-slow-stage-busy: the GPU-like slow-stage test of tests/bpf,
    tp=2, pp=2, dp=2 on 2 nodes x 4, stage 1 1.5x slower, in a CI run beside two cpu-hog lab
    loops, load ~25). Its ranks waited 20-74 ms/step for a CPU inside 54-94 ms of own work,
    node-b's most; stage 1, working longer, waited longer. Its own work less all that wait
    was 6.6 ms/step over the other stage's, a saving of 4.3% and no verdict; taken at the
    job's pooled rate of wait per ns of work, the wait leaves stage 1's excess standing."""
    _, rep = _lab_fixture("lab-gpu-slow-stage-busy")
    s = rep.straggler
    assert s is not None and (s.kind, s.ranks, s.cause) == ("stage", [2, 3, 6, 7], "compute/unknown"), s
    assert s.saving_pct > 10, s


def test_a_lab_io_stall_on_a_busy_machine_is_io():
    """A real run (fixtures/lab-gpu-io-stall-busy: `bench.verdict_lab` GPU-like io-stall, 2 nodes
    x 2 ranks, beside `--background-load 2` and other lab jobs on 2 cores; every table but the
    calls in flight). Rank 2 writes and fsyncs 8 MB a step: blocked 419 ms in all, and 797 ms
    more runnable after those wake-ups before it ran. Counted as runqueue wait, that tail left
    the I/O wait 29% of the excess own work, and the cause compute/unknown."""
    con, rep = _lab_fixture("lab-gpu-io-stall-busy")
    s = rep.straggler
    assert s is not None and (s.kind, s.rank, s.cause) == ("rank", 2, "io"), s
    blocked, queued, tails = con.execute(
        "SELECT sum(total_ns) FILTER (reason = 'io'), sum(total_ns) FILTER (reason = 'runqueue'), "
        "(SELECT sum(runq_ns) FROM sched_events WHERE rank = 2 AND reason = 'io') "
        "FROM sched_totals WHERE rank = 2").fetchone()
    off = next(r.offcpu_ms for r in rep.ranks if r.rank == 2)
    assert off["io"] * MS == pytest.approx(blocked + tails) and tails > blocked, (off, blocked, tails)
    assert (off["io"] + off["runqueue"]) * MS == pytest.approx(blocked + queued), off      # moved, not added


def test_a_lab_slow_rank_on_a_busy_machine_is_compute():
    """A real run (fixtures/lab-gpu-slow-rank-busy: the GPU-like slow-rank test of tests/bpf, 2
    nodes x 2 ranks, in a CI run beside two cpu-hog lab loops, load ~30). Every rank waited for
    a CPU most of its own work; rank 1 computes twice as long and so waited twice as long:
    against its peers' median wait that was 72% of its excess own work, named cpu-contention."""
    _, rep = _lab_fixture("lab-gpu-slow-rank-busy")
    s = rep.straggler
    assert s is not None and (s.kind, s.rank, s.cause) == ("rank", 1, "compute/unknown"), s
