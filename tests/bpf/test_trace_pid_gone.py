"""`ingero trace --pid` on processes that exit: before the probes are attached it fails
with one line naming them; after, it stops once they are all gone (no silent empty trace)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import bpf_reason

pytestmark = pytest.mark.bpf


@pytest.fixture(autouse=True)
def _bpf():
    reason = bpf_reason()
    if reason:
        pytest.skip(reason)


def test_pids_that_exit_before_the_probes_attach_fail_the_trace_with_their_names(tmp_path):
    short = subprocess.Popen(["sleep", "0.2"])      # gone long before bcc has compiled the probes
    try:
        r = subprocess.run([sys.executable, "-m", "ingero", "trace", "--pid", str(short.pid), "--duration", "30s",
                            "--probes", "sched", "--out", str(tmp_path / "t.duckdb")],
                           capture_output=True, text=True, timeout=180)
    finally:
        short.wait()
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert f"pid {short.pid} exited before the probes were attached" in last, r.stderr
    assert "loading them took" in last and "--cgroup" in last, last


def test_a_trace_stops_once_every_pid_target_has_exited(tmp_path):
    proc = subprocess.Popen(["sleep", "25"])
    ready = tmp_path / "ready"
    t = subprocess.Popen([sys.executable, "-m", "ingero", "trace", "--pid", str(proc.pid), "--duration", "10m",
                          "--probes", "sched", "--ready-file", str(ready), "--out", str(tmp_path / "t.duckdb")],
                         stderr=subprocess.PIPE, text=True)
    try:
        import time
        deadline = time.monotonic() + 120
        while not ready.exists() and t.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), t.stderr.read() if t.poll() is not None else "not ready"
        proc.kill()
        proc.wait()
        assert t.wait(timeout=60) == 0
        err = t.stderr.read()
        assert f"every target process exited (pid {proc.pid}); stopping" in err, err
        assert "completed: recorded" in err, err
    finally:
        for p in (proc, t):
            if p.poll() is None:
                p.kill()
                p.wait()
