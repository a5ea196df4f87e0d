#!/usr/bin/env bash
# Set up a virtualenv (CPU torch) and run the test suite. CI runs exactly this (.ci/run).
set -euo pipefail
. "$(dirname "$0")/_venv.sh" test
set +e
python -m pytest -q -ra "$@"
rc=$?
set -e
# pytest exit 5 = no tests collected: that must never count as a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit "$rc"
