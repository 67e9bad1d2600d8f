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
])
def test_bad_operator_flags_give_one_line_and_exit_2(flags, message):
    pytest.importorskip("kopf", reason="the operator's dependencies are not installed")
    p = subprocess.run([sys.executable, "-m", "ingero", "operator", "run", "--standalone", *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr.strip()) == (2, message)
