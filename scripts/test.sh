#!/usr/bin/env bash
# Set up a virtualenv (CPU torch) and run the test suite. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# The CPU build; an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set +e
python -m pytest -q -ra "$@"
rc=$?
set -e
# pytest exit 5 = no tests collected: that must never count as a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit "$rc"
