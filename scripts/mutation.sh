#!/usr/bin/env bash
# Mutation score of the verdict (ingero/analysis/verdict.py) against its hand-built unit
# tests, with mutmut (PyPI). Slow (each mutant reruns the tests that reach the mutated
# function), so no part of CI: `make mutation` (every mutant), or
# `scripts/mutation.sh 'ingero.analysis.verdict.x__arbitrate__mutmut_*' ...` for some;
# then `results` / `show NAME` the same way in $WORK/src (the last line below).
#
# mutmut imports the mutated copy from $WORK/mutants by putting it first on sys.path; the
# editable install's import finder would still map `ingero` to this tree, so the run happens
# in a copy, with a virtual environment that sees the project's dependencies (a .pth line
# to $VENV's site-packages) but not the project.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
WORK=${MUTATION_DIR:-$ROOT/.mutation}
# the verdict's hand-built unit tests: the synthetic sessions (test_verdict_matrix, _pipeline,
# _gpu, _rdma) cost seconds to minutes per mutant
TESTS=${MUTATION_TESTS:-"test_verdict_rules test_verdict_cause test_verdict_starved test_verdict_own_runqueue
  test_proxy_waits test_verdict_spread test_verdict_slow_nodes test_verdict_per_wait"}
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
py=$(readlink -f "$VENV/bin/python")

rm -rf "$WORK/src"
mkdir -p "$WORK/src/tests/unit"
if [ ! -x "$WORK/venv/bin/python" ]; then
    "$py" -m venv "$WORK/venv"
    echo "$site" > "$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/deps.pth"
fi
"$WORK/venv/bin/python" -c 'import mutmut' 2>/dev/null || "$WORK/venv/bin/python" -m pip install -q mutmut
cp -r "$ROOT/ingero" "$ROOT/bench" "$WORK/src/"
cp "$ROOT/tests/__init__.py" "$ROOT/tests/conftest.py" "$WORK/src/tests/"
for t in $TESTS; do cp "$ROOT/tests/unit/$t.py" "$WORK/src/tests/unit/"; done
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
{ sed -n '/^\[tool.pytest.ini_options\]/,/^\]/p' "$ROOT/pyproject.toml"
  printf '\n[tool.mutmut]\nsource_paths = ["ingero/analysis/verdict.py"]\nalso_copy = ["ingero", "bench"]\n'
  printf 'pytest_add_cli_args_test_selection = ["tests/unit"]\n'; } > "$WORK/src/pyproject.toml"
cd "$WORK/src"
"$WORK/venv/bin/python" -c 'from mutmut.__main__ import cli; cli()' run --max-children "${MUTATION_JOBS:-2}" "$@"
