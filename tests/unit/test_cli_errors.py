"""What a newcomer's mistakes print: the usage of the subcommand they typed, DuckDB's own
"Did you mean ..." hint, and one line (with the fix) for a file that is not a trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingero.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv,usage", [
    (["query", "--bogus", "t.duckdb"], "usage: ingero query "),
    (["lab", "run", "--bogus"], "usage: ingero lab run "),
    (["--bogus"], "usage: ingero "),
])
def test_an_unknown_flag_prints_the_usage_of_the_subcommand_it_was_given_to(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage), err
    assert err.rstrip().endswith("error: unrecognized arguments: --bogus")


@pytest.fixture
def trace(tmp_path) -> Path:
    from tests.unit.trace_fixture import write_node
    write_node(tmp_path / "seg", "node-a", [0, 1], steps=2)      # a node's real segments
    return tmp_path / "seg"


@pytest.mark.parametrize("sql,hint", [
    ("SELECT * FROM ncl_events", 'Did you mean "nccl_events"?'),
    ("SELECT durration_ns FROM nccl_events", 'Candidate bindings: "duration_ns"'),
])
def test_query_keeps_duckdbs_hint_on_one_line(trace, sql, hint, capsys):
    assert main(["query", str(trace), sql]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ingero: query failed: ") and hint in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["report", "query"])
def test_a_file_that_is_not_a_trace_is_one_line_with_the_fix(command, capsys):
    argv = [command, str(ROOT / "README.md")] + (["SELECT 1"] if command == "query" else [])
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert err.startswith(f"ingero: {ROOT / 'README.md'} is not a trace (DuckDB cannot open it: ") and \
        "pass a trace.duckdb" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("line,want", [
    ("ingero report --j", {"--json"}),
    ("kubectl-ingero l", {"list", "logs", "ls"}),
])
def test_shell_completion_offers_subcommands_and_flags(line, want):
    """As bash asks (register-python-argcomplete): the candidates come back on fd 8."""
    pytest.importorskip("argcomplete", reason="python3-argcomplete is not installed (make setup)")
    import subprocess
    import sys
    module = "ingero.kubectl_plugin" if line.startswith("kubectl") else "ingero.cli"
    env = {"PATH": "/usr/bin:/bin", "_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n", "COMP_LINE": line,
           "COMP_POINT": str(len(line)), "COMP_TYPE": "9", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "-c", '"$@" 8>&1 9>/dev/null', "-", sys.executable, "-m", module], env=env,
                         capture_output=True, text=True, timeout=60)
    assert {c.strip() for c in out.stdout.split("\n") if c.strip()} == want, (out.stdout, out.stderr)
