"""With CI=true a skipped suite fails the run (tests/conftest.py), except the kind e2e."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    tests = tmp_path / "tests"
    for sub in ("unit", "e2e"):
        (tests / sub).mkdir(parents=True)
        (tests / sub / f"test_{sub}_skip.py").write_text(
            "import pytest\n\ndef test_skips():\n    pytest.skip('no widget on this machine')\n")
    shutil.copy(CONFTEST, tests / "conftest.py")
    env = {"PATH": "/usr/bin:/bin"} | ({"CI": ci} if ci is not None else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-p", "no:kmock",
                           "-q", "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_with_ci_true_a_skip_outside_e2e_fails_naming_the_reason(tmp_path):
    p = _run(tmp_path, "true")
    assert p.returncode == 1, p.stdout
    assert "FAILED tests/unit/test_unit_skip.py::test_skips" in p.stdout
    assert "no widget on this machine" in p.stdout and "must run in CI" in p.stdout
    assert "SKIPPED [1] tests/e2e/test_e2e_skip.py" in p.stdout


def test_without_ci_skips_stay_skips_and_are_listed(tmp_path):
    p = _run(tmp_path, None)
    assert p.returncode == 0, p.stdout
    assert "2 skipped" in p.stdout and "FAILED" not in p.stdout


def test_the_lab_verdict_tests_run_beside_2_busy_processes_in_ci_unless_told_otherwise(monkeypatch):
    from tests.conftest import background_load

    cases = [({}, 0), ({"CI": "true"}, 2), ({"CI": "true", "INGERO_TEST_BACKGROUND_LOAD": "0"}, 0),
             ({"CI": "true", "INGERO_TEST_BACKGROUND_LOAD": "3"}, 3), ({"INGERO_TEST_BACKGROUND_LOAD": "1"}, 1),
             ({"CI": "false"}, 0)]
    for env, want in cases:
        for k in ("CI", "INGERO_TEST_BACKGROUND_LOAD"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert background_load() == want, env
