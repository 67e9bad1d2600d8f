"""`ingero operator run` refuses bad flags with one line naming the fix, before it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags,message", [
    (["--live-window", "-1"], "ingero: --live-window must be >= 0 seconds (0: judge the whole session only)"),
    (["--refresh-interval", "0"], "ingero: --refresh-interval must be > 0 seconds"),
    (["--artifacts", "/proc/no-such-dir"],
     "ingero: --artifacts /proc/no-such-dir: No such file or directory; pass a writable folder"),
    (["--artifact-port", "70000"], "ingero: --artifact-port 70000 is out of range: use 1 to 65535"),
    (["--artifact-service", "Operator_Svc"], "ingero: --artifact-service 'Operator_Svc' is not NAME or "
     "NAME:PORT (a Service name, and a port name or number)"),
])
def test_bad_operator_flags_give_one_line_and_exit_2(flags, message):
    pytest.importorskip("kopf", reason="the operator's dependencies are not installed")
    p = subprocess.run([sys.executable, "-m", "ingero", "operator", "run", "--standalone", *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr.strip()) == (2, message)


def test_a_taken_artifact_port_fails_the_start_naming_it(tmp_path):
    pytest.importorskip("kopf", reason="the operator's dependencies are not installed")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "ingero", "operator", "run", "--standalone", "--artifacts",
                            str(tmp_path), "--artifact-port", str(port), "--artifact-address", "127.0.0.1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr.strip()) == (2, f"ingero: --artifact-port {port}: Address already in use; "
                                                   "pick a free port")
