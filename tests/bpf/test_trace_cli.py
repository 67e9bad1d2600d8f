"""`ingero trace` end to end: what it prints, how it stops, what it keeps."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.bpf.conftest import spawn


def test_duration_ends_the_trace_with_start_progress_and_summary_lines(tmp_path):
    """A progress line a second: a trace of 2.5 s printed none in a CI run at load ~30."""
    out = tmp_path / "t.duckdb"
    r = subprocess.Popen([sys.executable, "-m", "ingero", "trace", "--all", "--probes", "sched",
                          "--duration", "6s", "--out", str(out), "--node", "n1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = r.communicate(timeout=120)
    assert r.returncode == 0, stderr
    lines = stderr.splitlines()
    assert any(ln.startswith("ingero: tracing sched for all processes on node n1") for ln in lines)
    assert sum(" events: sched " in ln for ln in lines) >= 1
    assert any(ln.startswith("ingero: completed: recorded ") for ln in lines)
    import duckdb
    con = duckdb.connect(str(out), read_only=True)
    n = con.execute("SELECT COUNT(*) FROM sched_events").fetchone()[0]
    assert n > 0
    # every process but the tracer itself (its tgid, in a map the loader fills)
    assert con.execute("SELECT COUNT(*) FROM sched_events WHERE pid = ?", [r.pid]).fetchone()[0] == 0
    assert con.execute("SELECT status, probes FROM sessions").fetchall() == [("completed", "sched")]
    assert con.execute("SELECT events_sched, lost_sched FROM nodes").fetchall() == [(n, 0)]
    assert (tmp_path / "t.duckdb.segments" / "sched_events").is_dir()
    # the RDMA ports' counters are read every second whatever the probes: a machine without
    # InfiniBand/RoCE (this one: no CONFIG_INFINIBAND) gives empty tables and no error
    ports = list(Path("/sys/class/infiniband").glob("*/ports/*"))
    assert con.execute("SELECT count(*) FROM rdma_ports").fetchone()[0] == len(ports)
    if not ports:
        assert con.execute("SELECT count(*) FROM rdma_counters").fetchone()[0] == 0
    assert not [ln for ln in lines if "rror" in ln or "Traceback" in ln], lines


def test_sigterm_stops_the_trace_and_keeps_every_recorded_event(fake_nccl, trace, tmp_path):
    go = tmp_path / "go"
    drv = spawn([str(fake_nccl["driver"]), "50", "2", "0", "1", str(go)])
    t = trace("--pid", str(drv.pid), "--probes", "nccl", "--quiet")
    go.touch()
    assert drv.wait(30) == 0
    t.proc.send_signal(signal.SIGTERM)        # right away: the events are still in the ring
    t.stop()
    assert t.query("SELECT COUNT(*) FROM nccl_events") == [(50 + 19,)]
    assert t.query("SELECT status FROM sessions") == [("stopped",)]
    assert not any(" events: " in ln for ln in t.lines)     # --quiet: no progress lines


def test_hidden_ebpf_flag_prints_the_program_and_its_cflags():
    r = subprocess.run([sys.executable, "-m", "ingero", "trace", "--ebpf", "--probes", "tcp,sched",
                        "--sched-min-us", "250"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("// cflags: ")
    assert "-DINGERO_SCHED_MIN_NS=250000ULL" in r.stdout.splitlines()[0]
    assert "-DINGERO_RAW_TP=" in r.stdout.splitlines()[0]
    assert "RAW_TRACEPOINT_PROBE(tcp_retransmit_skb)" in r.stdout
    assert "TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)" in r.stdout
    assert "INGERO_TRACEPOINT(sched, sched_switch)" in r.stdout
    assert "nccl_enter_ncclAllReduce" not in r.stdout          # family not selected


def test_done_file_appears_with_every_event_on_disk_before_the_probes_detach(fake_nccl, trace, tmp_path):
    from ingero.readonly_sql import open_source

    go, done = tmp_path / "go", tmp_path / "done"
    drv = spawn([str(fake_nccl["driver"]), "30", "2", "0", "1", str(go)])
    t = trace("--pid", str(drv.pid), "--probes", "nccl", "--quiet", "--done-file", str(done))
    go.touch()
    assert drv.wait(30) == 0
    t.proc.send_signal(signal.SIGINT)
    import time
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done.exists()
    # read the segments as the agent would at this moment, whether or not the tracer has exited
    segs = t.out.with_name(t.out.name + ".segments")
    con = open_source(segs)
    assert con.execute("SELECT COUNT(*) FROM nccl_events").fetchone() == (30 + 19,)
    con.close()
    t.stop()
