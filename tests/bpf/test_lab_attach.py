"""Late attach on real eBPF: one lab job (CPU device, 2 nodes; data-parallel or tp=2,pp=2,dp=2)
traced from its start (a tracer per node, as `ingero lab run --trace`) and, ~10 s after
its ranks started, by `ingero trace --pid <its workers>` per node (or `--pods`, as the
agent of a TraceSession created on running pods). The late trace sees no
communicator created (every call has rank -1, comm hash 0): the analysis recovers them
from the calls (ingero/analysis/recover.py) and must name the same rank and cause.

The late tracer runs until its --duration; then the job is stopped (its stop file), so
the test does not depend on how long the probes take to load on a busy machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.conftest import bpf_reason

pytestmark = pytest.mark.bpf

ATTACH_AFTER_S = 10.0
LATE_TRACE_S = 12


def _verdict(db):
    from ingero.analysis import analyse
    from ingero.readonly_sql import open_source

    con = open_source(db)
    try:
        return analyse(con)
    finally:
        con.close()


def _run(tmp_path, scenario: str, by: str = "pid", **kw):
    """The lab job, its trace from the start and its late trace (`by`: "pid", the workers'
    pids; "pods", the pods file, as the agent of a TraceSession created on running pods)."""
    from ingero.lab import tracers as tr
    from ingero.lab.runner import LabConfig, LabRun
    from ingero.store import build_duckdb

    stop = tmp_path / "stop"
    cfg = LabConfig(**{"scenario": scenario, "nodes": 2, "ranks_per_node": 2, "seconds": 120, "stop_file": stop,
                       "out_dir": tmp_path / "lab", **kw})
    with LabRun(cfg, log=lambda _m: None) as lab:
        tracers = tr.start_lab_tracers(lab)
        lab.start_ranks()
        started = time.time()
        time.sleep(ATTACH_AFTER_S)
        late = {}          # an `ingero trace --pid` per lab node, as an agent per node would run
        for node in lab.nodes:
            if by == "pid":
                targets = ["--pid", *[str(rp.proc.pid) for rp in lab.ranks if rp.node is node]]
            else:
                targets = ["--pods", str(lab.pods_file(node))]
            out = tmp_path / "late" / f"{node.name}.duckdb"
            out.parent.mkdir(exist_ok=True)
            log = open(out.with_suffix(".log"), "wb")
            late[node.name] = (out, subprocess.Popen(
                [sys.executable, "-m", "ingero", "trace", *targets, "--node", node.name, "--out", str(out),
                 "--duration", f"{LATE_TRACE_S}s", "--ready-file", str(out.with_suffix(".ready")), "--quiet"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.close()
        try:
            for name, (out, proc) in late.items():
                assert proc.wait(timeout=240) == 0, out.with_suffix(".log").read_text()
        finally:
            for _, proc in late.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        attached_after = min(out.with_suffix(".ready").stat().st_mtime for out, _ in late.values()) - started
        stop.touch()
        codes = lab.wait(timeout_s=120)
        stops = tr.stop_tracers(tracers)
        report = lab.report()
    late_db = tmp_path / "late.duckdb"
    build_duckdb([out.with_name(out.name + ".segments") for out, _ in late.values()], late_db)
    full_db = tr.merge(tracers, lab.out / "trace.duckdb")
    assert set(codes.values()) == {0}, f"rank exit codes {codes}; logs in {lab.out / 'logs'}"
    assert set(stops.values()) == {0}, f"tracer exit codes {stops}"
    return report, _verdict(full_db), _verdict(late_db), late_db, attached_after


DP = ["0, 1", "0, 1, 2, 3", "0, 1, 2, 3", "2, 3"]        # C of node a, A and B (world), C of node b
# tp=2,pp=2,dp=2 (Megatron's order, 1F1B, no world collective): TP pairs (0, 1)..., DP
# pairs (0, 4)..., and PP pairs (0, 2)... that only send and receive. The embedding pairs of
# first and last stage ((0, 2)... again) run in step with their tensor-parallel twins: where
# the overlap of their calls tells them apart they are recovered, where it does not they are
# left out (recover.MIN_CONF); never grouped wrong
LAYOUT = sorted([f"{a}, {a + 1}" for a in (0, 2, 4, 6)] + [f"{a}, {a + 4}" for a in range(4)]
                + [f"{a}, {a + 2}" for a in (0, 1, 4, 5)])
EMBEDDING = [f"{a}, {a + 2}" for a in (0, 1, 4, 5)]


# One case in CI (the lab group runs one job at a time: every case costs 60-90 s): the 3D job,
# whose tensor, data, pipeline (and embedding) communicators are recovered; the data-parallel
# cases (slow-rank by --pid and by --pods, lossy-link) are extended (INGERO_TEST_LAB_ALL=1). A
# TraceSession on running pods is checked by tests/cluster/test_whole_flow.py (io-stall, applied late).
CASES = [pytest.param("slow-stage", {"layout": "tp=2,pp=2,dp=2", "ranks_per_node": 4, "stage": 1}, LAYOUT,
                      id="slow-stage-3d"),
         pytest.param("slow-rank", {}, DP, id="slow-rank", marks=pytest.mark.extended),
         pytest.param("slow-rank", {"by": "pods"}, DP, id="slow-rank-pods", marks=pytest.mark.extended),
         pytest.param("lossy-link", {}, DP, id="lossy-link", marks=pytest.mark.extended)]


@pytest.mark.parametrize("scenario,kw,comms", CASES)
def test_a_job_attached_late_gets_the_verdict_of_one_traced_from_its_start(tmp_path, scenario, kw, comms):
    reason = bpf_reason()
    if reason:
        pytest.skip(reason)
    import duckdb

    report, full, late, late_db, attached_after = _run(tmp_path, scenario, **kw)
    world = list(range(len(report["ranks"])))
    assert attached_after >= ATTACH_AFTER_S
    con = duckdb.connect(str(late_db), read_only=True)
    try:
        # every rank recorded NCCL and scheduler events, TCP events were owned; none saw a
        # communicator created
        for table, rank in (("nccl_events", "global_rank"), ("sched_events", "rank")):
            got = con.execute(f"SELECT list_sort(list(DISTINCT {rank})) FROM {table}").fetchone()
            assert got == (world,), (table, got)
        assert con.execute("SELECT count(*) FROM tcp_events WHERE rank IS NOT NULL").fetchone()[0] > 0
        assert con.execute("SELECT count(*) FROM nccl_events WHERE comm_id_hash <> 0").fetchone() == (0,)
        assert con.execute("SELECT list_sort(list(DISTINCT rank)) FROM ranks").fetchone() == (world,)
    finally:
        con.close()
    from ingero.analysis.calls import load
    from ingero.readonly_sql import open_source

    src = open_source(late_db)
    try:
        calls, warnings = load(src)
    finally:
        src.close()
    got = Counter(", ".join(map(str, m)) for m in calls.comm_members.values())
    missing, extra = Counter(comms) - got, got - Counter(comms)
    allowed = Counter(EMBEDDING if comms is LAYOUT else [])
    assert not missing and not extra - allowed, (sorted(got.elements()), warnings)
    assert comms is LAYOUT or not any("matched no other rank" in w for w in warnings), warnings
    assert any("no device times" in w for w in late.warnings), late.warnings
    assert not any("cycles" in w for w in late.warnings), late.warnings
    s_full, s_late = full.straggler, late.straggler
    assert s_full is not None, (full.best_candidate, full.warnings)
    assert s_full.kind != "rank" or s_full.rank == report["victim_rank"], s_full
    assert s_late is not None, (late.best_candidate, late.warnings)
    assert (s_late.kind, s_late.cause, s_late.group) == (s_full.kind, s_full.cause, s_full.group), (s_late, s_full)
    assert s_late.kind != "rank" or s_late.rank == s_full.rank, (s_late, s_full)
