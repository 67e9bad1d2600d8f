"""A trace that cannot support a verdict says so, with the reason and counts, never "straggler: none".

Each trace is written through the real segment store and read back through the
real DuckDB views (`ingero report`'s path)."""

from __future__ import annotations

import json

import pytest

from ingero.analysis import analyse
from ingero.cli import main
from ingero.store import SegmentWriter
from ingero.readonly_sql import open_source
from tests.unit.trace_fixture import write_job

T0 = 1_760_000_000_000_000_000
STEP = 50_000_000
COMM = 0x0123_4567_89AB_CDEF


def node(root, name, calls, ranks=(), world=None, sched=0):
    """Write node `name`: `calls` as (rank in the ranks table or None, global_rank, comm
    rank, op, comm hash, seq, t_ns) and a ranks row per entry of `ranks`."""
    w = SegmentWriter(root / name, name, "s")
    if calls:
        cols = {k: [] for k in ("timestamp_ns", "duration_ns", "op", "rank", "nranks", "comm_id_hash", "seq",
                                "pid", "tid", "global_rank", "ret")}
        for pid, grank, crank, op, comm, seq, t in calls:
            for k, v in (("timestamp_ns", t), ("duration_ns", 1_000_000), ("op", op), ("rank", crank),
                         ("nranks", 4), ("comm_id_hash", comm), ("seq", seq), ("pid", pid), ("tid", pid),
                         ("global_rank", grank), ("ret", 0)):
                cols[k].append(v)
        w.append("nccl_events", cols)
    if sched:
        w.append("sched_events", {"timestamp_ns": [T0 + i for i in range(sched)], "duration_ns": [1000] * sched,
                                  "reason": ["sleep"] * sched, "pid": [1000] * sched})
    if ranks:
        w.put_rows("ranks", [{"pid": 1000 + r, "rank": r, "world_size": world or len(ranks)} for r in ranks])
    w.put_rows("sessions", [{"started_ns": T0, "ended_ns": T0 + 100 * STEP, "status": "finished"}])
    w.close()


def steps(ranks, n=20, comm=COMM, grank=True, crank=True):
    """`n` steps of one ALL_REDUCE per rank, as node() takes them."""
    return [(1000 + r, r if grank else None, r if crank else None, "ALL_REDUCE", comm, s, T0 + s * STEP + 1000 * r)
            for r in ranks for s in range(n)]


def report(tmp_path):
    rep = analyse(open_source(tmp_path))
    assert rep.verdict == "cannot-judge" and rep.straggler is None and rep.covered_ranks is None
    assert rep.to_dict()["verdict"] == "cannot-judge"
    return rep


def cli(tmp_path, capsys) -> str:
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "straggler: none" not in out and "verdict: cannot judge: " in out
    assert main(["report", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "cannot-judge"
    return out


def test_a_trace_without_nccl_calls_cannot_be_judged(tmp_path, capsys):
    node(tmp_path, "n1", [], ranks=range(4), sched=7)
    rep = report(tmp_path)
    assert rep.cannot_judge == ("no NCCL collective or point-to-point call was traced (0 other NCCL rows, 0 TCP "
                                "and 7 scheduler events; the trace names ranks 0-3)")
    assert "no NCCL collective or point-to-point call was traced" in cli(tmp_path, capsys)


def test_calls_whose_communicators_are_unknown_cannot_be_judged_and_are_counted(tmp_path, capsys):
    # communicators created before the probes attached: comm_id_hash 0, communicator rank -1
    calls = [(p, g, -1, op, 0, s, t) for p, g, _, op, _, s, t in steps(range(4), 30)]
    node(tmp_path, "n1", calls, ranks=range(4))
    rep = report(tmp_path)
    assert rep.cannot_judge.startswith("none of the 120 NCCL calls can be placed: 120 with an unknown "
                                       "communicator (comm_id_hash 0")
    assert "none of the 120 NCCL calls can be placed" in cli(tmp_path, capsys)


def test_calls_of_processes_without_a_rank_cannot_be_judged_and_are_counted(tmp_path):
    # no ranks row, no torchrun RANK, and no communicator rank
    calls = steps(range(3), 10, grank=False, crank=False)
    calls += [(p, None, -1, op, 0, s, t) for p, _, _, op, _, s, t in steps([3], 5)]
    node(tmp_path, "n1", calls)
    rep = report(tmp_path)
    assert rep.cannot_judge == ("none of the 35 NCCL calls can be placed: 5 with an unknown communicator "
                                "(comm_id_hash 0: created before the probes attached); 30 from processes of "
                                "unknown rank (no torchrun RANK, no ranks row, no communicator rank)")


def test_one_rank_alone_cannot_be_judged(tmp_path, capsys):
    node(tmp_path, "n1", steps([0], 30), ranks=[0])
    rep = report(tmp_path)
    assert rep.cannot_judge == ("only rank 0 made NCCL calls the analysis can place, of 1 ranks known; "
                                "a verdict compares at least 2 ranks")
    assert len(rep.ranks) == 1 and rep.ranks[0].collectives == 30
    assert "only rank 0 made NCCL calls" in cli(tmp_path, capsys)


def test_a_traced_rank_that_made_no_call_makes_the_trace_unjudgeable(tmp_path, capsys):
    # ranks 0-2 call; rank 3 is traced (its process has a ranks row) but never calls NCCL,
    # and rank 2's calls are on a communicator created before the probes attached
    calls = steps(range(2), 30) + [(p, g, -1, op, 0, s, t) for p, g, _, op, _, s, t in steps([2], 30)]
    node(tmp_path, "n1", calls, ranks=range(4))
    rep = report(tmp_path)
    assert rep.cannot_judge == ("2 of 4 ranks are traced but made no NCCL call the analysis can place (ranks 2-3; "
                                "rank 2: 30 calls that cannot be placed; 30 with an unknown communicator "
                                "(comm_id_hash 0: created before the probes attached)): any of them may be the "
                                "rank the others wait for")
    assert [r.rank for r in rep.ranks] == [0, 1]
    assert "2 of 4 ranks are traced but made no NCCL call" in cli(tmp_path, capsys)


def test_a_traced_node_that_sent_no_call_makes_the_trace_unjudgeable(tmp_path, capsys):
    node(tmp_path, "node-a", steps(range(2), 30), ranks=range(2))
    node(tmp_path, "node-b", [])          # its agent ran the session and found nothing to send
    rep = report(tmp_path)
    assert rep.cannot_judge == ("1 of 2 traced nodes sent no NCCL call (node-b): their ranks may be the ones "
                                "the others wait for")
    assert "1 of 2 traced nodes sent no NCCL call" in cli(tmp_path, capsys)


def test_calls_that_form_no_recurring_step_cannot_be_judged(tmp_path, capsys):
    # point-to-point calls only: nothing recurs on every rank, so there is no step
    calls = [(1000 + r, r, r, "SEND" if r % 2 == 0 else "RECV", COMM, s, T0 + s * STEP + r) for r in range(4)
             for s in range(20)]
    node(tmp_path, "n1", calls, ranks=range(4))
    rep = report(tmp_path)
    assert rep.cannot_judge == ("no collective recurs often enough on the 4 ranks to mark whole steps: no step "
                                "to judge (80 calls placed)")
    assert "no collective recurs often enough" in cli(tmp_path, capsys)


def test_a_verdict_on_part_of_the_job_says_which_ranks_it_covers(tmp_path, capsys):
    root = tmp_path / "segments"
    write_job(root, steps=30)
    rep = analyse(open_source(root))
    assert rep.verdict == "straggler" and rep.covered_ranks is None    # every rank of the 4
    part = tmp_path / "part"
    from tests.unit.trace_fixture import write_node
    write_node(part / "node-a", "node-a", [0, 1], steps=30, world=8)
    write_node(part / "node-b", "node-b", [2, 3], steps=30, world=8)
    rep = analyse(open_source(part))
    assert rep.verdict == "straggler" and rep.straggler.rank == 3 and rep.covered_ranks == [0, 1, 2, 3]
    assert "the verdict covers ranks 0-3 of the job's 8: ranks 4-7 were not traced" in rep.warnings
    assert main(["report", str(part)]) == 0
    out = capsys.readouterr().out
    assert "verdict: straggler (covers ranks 0-3 only)" in out and "straggler: rank 3" in out
    assert main(["export", "step", str(part), "-o", str(tmp_path / "s.svg")]) == 0
    assert "; covers ranks 0-3 only" in (tmp_path / "s.svg").read_text()


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3, 6, 8, 9], [5]])
def test_rank_spans_read_compactly(ranks):
    from ingero.analysis.coverage import span
    assert span(ranks) == {7: "0-3, 6, 8-9", 1: "5"}[len(ranks)]


def test_calls_that_cannot_be_placed_beside_a_verdict_are_counted_in_a_warning(tmp_path, capsys):
    late = [(p, g, -1, op, 0, s, t + 500) for p, g, _, op, _, s, t in steps([0], 10)]   # before the attach
    node(tmp_path, "n1", steps(range(4), 30) + late, ranks=range(4))
    rep = analyse(open_source(tmp_path))
    assert rep.verdict == "none" and rep.cannot_judge is None and rep.covered_ranks is None
    assert ("10 of 130 NCCL calls cannot be placed, and the verdict does not weigh them: 10 with an unknown "
            "communicator (comm_id_hash 0: created before the probes attached)") in rep.warnings
    assert main(["report", str(tmp_path)]) == 0
    assert "verdict: none" in capsys.readouterr().out.splitlines()


def test_the_step_picture_of_an_unjudgeable_trace_says_why_there_is_no_step(tmp_path, capsys):
    node(tmp_path / "t", "n1", steps(range(2), 30), ranks=range(4))
    assert main(["export", "step", str(tmp_path / "t"), "-o", str(tmp_path / "s.svg")]) == 2
    err = capsys.readouterr().err
    assert "no step to draw: 2 of 4 ranks are traced but made no NCCL call" in err and not (tmp_path / "s.svg").exists()


def test_ranks_with_calls_but_no_whole_step_are_left_out_of_the_verdict_and_named(tmp_path):
    # ranks 4 and 5 only meet once, on a communicator of their own: no step for them
    once = [(1000 + r, r, r - 4, "ALL_REDUCE", COMM + 1, 0, T0 + 5 * STEP + r) for r in (4, 5)]
    node(tmp_path, "n1", steps(range(4), 30) + once, ranks=range(6))
    rep = analyse(open_source(tmp_path))
    assert rep.verdict == "none" and rep.covered_ranks == [0, 1, 2, 3]
    assert "the verdict covers ranks 0-3 of the job's 6: ranks 4-5 made calls but have no whole step" in rep.warnings


def test_calls_of_a_process_without_any_rank_are_left_out_not_a_crash(tmp_path):
    # two ranked ranks, and a process with no ranks row, no torchrun RANK and no rank in its
    # communicator (-1) calling on the same, known communicator
    stray = [(2000, None, -1, "ALL_REDUCE", COMM, s, T0 + s * STEP + 5000) for s in range(20)]
    node(tmp_path, "a", steps([0, 1]) + stray, ranks=[0, 1])
    rep = analyse(open_source(tmp_path))
    assert rep.verdict == "none" and {r.rank for r in rep.ranks} == {0, 1}
    assert any("20 calls of processes without a rank were left out" in w for w in rep.warnings)


def test_the_calls_read_counts_what_the_coverage_query_counts(tmp_path):
    from ingero.analysis.calls import load
    from ingero.analysis.coverage import coverage

    # placed calls; one on an unknown communicator, one without a seq; one of a process without a rank
    node(tmp_path, "n1", steps(range(2)) + [(1000, 0, 0, "ALL_REDUCE", 0, 50, T0 + 7),
                                            (1001, 1, 1, "ALL_REDUCE", COMM, None, T0 + 9)], ranks=range(2))
    node(tmp_path, "n2", steps(range(2, 4)) + [(2000, None, None, "ALL_REDUCE", COMM, 3, T0)], ranks=range(2, 4))
    con = open_source(tmp_path)
    c, _ = load(con)
    cov = coverage(con, c.counted)
    assert (cov.calls, cov.no_comm, cov.no_seq, cov.no_rank, cov.dropped_by_rank) == (83, 1, 1, 1, {0: 1, 1: 1})
    assert cov == coverage(con) and cov.nodes_calling == ["n1", "n2"]
    assert c.n == 80
