"""A lab tracer that does not stop: its threads' stacks reach its log before it is killed."""

from __future__ import annotations

import subprocess
import sys
import time

from ingero.lab.tracers import NodeTracer, TracedRun, stop_tracers

STUCK = """
import faulthandler, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
faulthandler.register(signal.SIGUSR1, all_threads=True)
open(sys.argv[1], "w").close()
def finishing_forever():
    while True:
        time.sleep(0.05)
finishing_forever()
"""


def test_a_tracer_stuck_after_sigint_leaves_its_stacks_in_the_log(tmp_path):
    log, ready = tmp_path / "node-a.tracer.log", tmp_path / "node-a.ready"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", STUCK, str(ready)], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t = NodeTracer("node-a", proc, tmp_path / "node-a.duckdb", ready, log)
    codes = stop_tracers([t], timeout_s=1)
    assert codes == {"node-a": -9}
    told = TracedRun(db=tmp_path / "x", report={}, codes={}, stops=codes, logs={"node-a": log}).stops_told()
    assert "finishing_forever" in told, told
    assert "had not stopped 1 s after SIGINT" in told, told
