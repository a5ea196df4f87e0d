#!/usr/bin/env bash
# Set up a virtualenv (CPU torch) and run the end-to-end demo: trainer-svc + rollout-svc on this
# machine with a tiny model, weight syncs driven by wsctl, and a short report.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[train]' matplotlib
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m weightsync.demo "$@"
