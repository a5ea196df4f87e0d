# Sourced by scripts/test.sh and scripts/demo.sh: create/activate .venv with the CPU build of torch.
# Usage: . scripts/_venv.sh EXTRAS   (e.g. test, train)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# The CPU build; an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[$1]"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
