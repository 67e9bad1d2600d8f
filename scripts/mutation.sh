#!/usr/bin/env bash
# Mutation score of the verdict (ingero/analysis/verdict.py) against its hand-built unit
# tests, with mutmut (PyPI). Slow (each mutant reruns the tests that reach the mutated
# function), so no part of CI: `make mutation` (the mutants of the decision functions,
# DECISIONS below), `scripts/mutation.sh 'ingero.analysis.verdict.x__weigh__mutmut_*' ...`
# for some, `scripts/mutation.sh 'ingero.analysis.verdict.*'` for every mutant of the file;
# then `results` / `show NAME` the same way in $WORK/src (the last line below).
# `scripts/mutation.sh --listed` (`make mutation-listed`) runs the same tests against the
# thirty hand-written mutations of ingero/analysis in scripts/mutation_listed.py instead.
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
  test_proxy_waits test_verdict_spread test_verdict_slow_nodes test_verdict_per_wait test_verdict_edges"}
# the functions that decide who is named and why
DECISIONS="_arbitrate _against_network _own_offcpu _role_peers _peer_median _network _offcpu_cause
  _weigh _per_wait_ratio _offcpu_floor_ms _starved_behind _slow_nodes _spread_beats _named _spread_estimate"
LISTED=0
if [ "${1:-}" = "--listed" ]; then
    LISTED=1
    shift
elif [ $# -eq 0 ]; then
    for f in $DECISIONS; do set -- "$@" "ingero.analysis.verdict.x_${f}__mutmut_*"; done
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
py=$(readlink -f "$VENV/bin/python")
SRC=$WORK/$([ $LISTED = 1 ] && echo listed || echo src)

rm -rf "$SRC"
mkdir -p "$SRC/tests/unit"
if [ ! -x "$WORK/venv/bin/python" ]; then
    "$py" -m venv "$WORK/venv"
    echo "$site" > "$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/deps.pth"
fi
cp -r "$ROOT/ingero" "$ROOT/bench" "$SRC/"
cp "$ROOT/tests/__init__.py" "$ROOT/tests/conftest.py" "$SRC/tests/"
for t in $TESTS; do cp "$ROOT/tests/unit/$t.py" "$SRC/tests/unit/"; done
cp -r "$ROOT/tests/unit/fixtures" "$SRC/tests/unit/"     # the lab's proxy sends (test_proxy_waits)
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
{ sed -n '/^\[tool.pytest.ini_options\]/,/^\]/p' "$ROOT/pyproject.toml"
  printf '\n[tool.mutmut]\nsource_paths = ["ingero/analysis/verdict.py"]\nalso_copy = ["ingero", "bench"]\n'
  printf 'pytest_add_cli_args_test_selection = ["tests/unit"]\n'; } > "$SRC/pyproject.toml"
cd "$SRC"
if [ $LISTED = 1 ]; then
    exec "$WORK/venv/bin/python" "$ROOT/scripts/mutation_listed.py" "$SRC" $(for t in $TESTS; do echo "tests/unit/$t.py"; done)
fi
"$WORK/venv/bin/python" -c 'import mutmut' 2>/dev/null || "$WORK/venv/bin/python" -m pip install -q mutmut
"$WORK/venv/bin/python" -c 'from mutmut.__main__ import cli; cli()' run --max-children "${MUTATION_JOBS:-2}" "$@"
