# Sourced by every recipe (bench/recipes/<name>.sh): the device call's environment and bounded steps.
#   OUT    where everything that comes back goes (default /tmp/out): result files (the schema's names,
#          one folder per step), every step's log in $OUT/logs.tar.gz (kept whatever stops the call)
#   LIMIT  seconds for the whole call (default 560: one 10-minute device call with room to copy back)
# The GPU hosts have no network: the services' wheels (megatron-core, grpcio, protobuf, the HTTP stack)
# travel in .whl/ (docs/BENCHMARKS.md, "Running benchmarks") and are installed into /tmp/site here.
#   step SECONDS NAME CMD...   CMD bounded by SECONDS and by what is left of LIMIT (5 s kept for `pack`), its
#                              results in $OUT/NAME/ (BENCH_RESULTS_DIR), its output in $LOGS/NAME.log
#   show NAME LINES            the end of a step's log, warnings left out
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} WS_LOCAL_OMP_THREADS=${WS_LOCAL_OMP_THREADS:-8}
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$LOGS"
LIMIT=${LIMIT:-560}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1 2>/dev/null;
  python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$LOGS/gpus.txt"
PYTEST=(python3 -m pytest -v -s -m gpu -p no:cacheprovider -o addopts="")
pack() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs $(ls -d /tmp/bench_services-* 2>/dev/null) 2>/dev/null \
         && rm -rf "$LOGS"; echo "== $(date -u +%H:%M:%S) logs in $OUT/logs.tar.gz (${SECONDS}s)"; }
trap pack EXIT
step() { local t=$1 name=$2; shift 2; local left=$((LIMIT - SECONDS - 5))
         if [ "$left" -lt 20 ]; then echo "== skipped (time): $name" | tee -a "$LOGS/summary.txt"; return; fi
         [ "$t" -gt "$left" ] && t=$left
         mkdir -p "$OUT/$name"
         echo "== $(date -u +%H:%M:%S) ${t}s: $name: $*" | tee -a "$LOGS/summary.txt"
         BENCH_RESULTS_DIR="$OUT/$name" timeout "$t" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
         echo "== $name: exit $rc after ${SECONDS}s total" | tee -a "$LOGS/summary.txt"; }
show() { grep -v -i warn "$LOGS/$1.log" | tail -"$2"; }
