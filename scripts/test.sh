#!/usr/bin/env bash
# Set up a virtualenv (CPU torch) and run the test suite. CI runs exactly this (.ci/run).
set -euo pipefail
. "$(dirname "$0")/_venv.sh" test
set +e
# Two pytest-xdist workers (CI has 2 cores; most tests wait on service processes), each test file on
# one worker (its module-scoped services and caches are built once); tests marked `serial` (timings)
# run while no other test does (tests/conftest.py). Not -q: the header (plugins, xdist's workers, a
# random-order plugin's seed where one is installed) stays in the CI log, so a run can be replayed.
python -m pytest -n 2 --dist loadfile -ra "$@"
rc=$?
set -e
# pytest exit 5 = no tests collected: that must never count as a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit "$rc"
