"""`ingero trace` argument handling: durations, probe names, and bad input
giving one line on stderr and a non-zero exit (no root needed: these are
checked before anything is loaded)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ingero.cli import main
from ingero.errors import IngeroError
from ingero_agent.trace_cli import parse_duration, parse_probes


@pytest.mark.parametrize("text,seconds", [
    ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0), ("45", 45.0), ("1.5m", 90.0),
    ("500ms", 0.5), (" 10s ", 10.0),
])
def test_duration_accepts_seconds_minutes_hours_and_plain_numbers(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10x", "-5s", "0", "1d"])
def test_duration_rejects_what_is_not_a_positive_duration(text):
    with pytest.raises(IngeroError, match="is not a duration"):
        parse_duration(text)


def test_probes_keep_canonical_order_and_reject_unknown_names():
    assert parse_probes("sched,nccl") == ("nccl", "sched")
    with pytest.raises(IngeroError, match="unknown probe gpu"):
        parse_probes("nccl,gpu")


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err.startswith("ingero: ") and "\n" not in err and "Traceback" not in err
    return err


def test_unknown_probe_is_one_line_error(capsys):
    assert "unknown probe disk" in _one_line_error(capsys, ["trace", "--probes", "disk", "--all"])


def test_missing_pid_is_one_line_error(capsys):
    err = _one_line_error(capsys, ["trace", "--pid", "999999999"])
    assert "pid 999999999 does not exist" in err


def test_non_numeric_pid_is_one_line_error(capsys):
    assert "is not a number" in _one_line_error(capsys, ["trace", "--pid", "abc"])


def test_missing_cgroup_is_one_line_error(capsys, tmp_path):
    err = _one_line_error(capsys, ["trace", "--cgroup", str(tmp_path / "nope")])
    assert "does not exist" in err and "nope" in err


def test_nccl_lib_without_nccl_symbols_is_one_line_error(capsys, tmp_path):
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\x7fELF" + bytes(200))
    err = _one_line_error(capsys, ["trace", "--all", "--nccl-lib", str(lib)])
    assert "defines no NCCL functions" in err


def test_missing_nccl_lib_is_one_line_error(capsys, tmp_path):
    err = _one_line_error(capsys, ["trace", "--all", "--nccl-lib", str(tmp_path / "x.so")])
    assert "does not exist" in err


def test_bad_duration_is_one_line_error(capsys):
    assert "is not a duration" in _one_line_error(capsys, ["trace", "--all", "--duration", "soon"])


def test_no_target_is_one_line_error(capsys):
    assert "nothing to trace" in _one_line_error(capsys, ["trace", "--probes", "nccl"])


def test_bad_pods_file_names_the_item(capsys, tmp_path):
    f = tmp_path / "pods.json"
    f.write_text('{"pods": [{"name": "w-0"}]}')
    err = _one_line_error(capsys, ["trace", "--pods", str(f)])
    assert "pods[0]" in err and "'uid'" in err


def test_without_root_trace_says_root_is_needed(tmp_path):
    argv = [sys.executable, "-m", "ingero", "trace", "--all", "--duration", "1s",
            "--out", str(tmp_path / "t.duckdb")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is missing: cannot drop privileges")
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"] + argv
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs root" in lines[0], r.stderr


@pytest.mark.parametrize("seconds", ["0", "-1", "1e400", "nan"])
def test_segment_seconds_out_of_range_is_one_line_error(capsys, seconds):
    assert "--segment-seconds" in _one_line_error(capsys, ["trace", "--all", "--segment-seconds", seconds])
