#!/usr/bin/env bash
# The fixed cost of a colocated trainer_writes sync on one GPU (docs/BENCHMARKS.md, "The colocated trainer_writes
# sync, 2026-11-26"), one call of at most LIMIT seconds (default 230):
#   1. the GPU test of the services with the trainer writing into the engine (bf16 trainer, its own storage):
#      PrepareSync now goes on the sync's own thread over the sync link;
#   2. bench_services, megatron trainer, 1.5B (its fixed cost is most of its sync), trainer_writes, 10 timed
#      syncs, both services timed by bench/profile (prepare and commit in their halves, the rollout's handlers,
#      the megatron flat export's parts): $OUT/prof.txt;
#   3. with BASE=<a checkout of the code before, e.g. main>: the same bench from there, for the before/after.
#
#   OUT=/tmp/out BASE=/path/to/main bash bench/run_fixed_cost_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export WS_LOCAL_OMP_THREADS=${WS_LOCAL_OMP_THREADS:-8}
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$LOGS"
LIMIT=${LIMIT:-230}
. "$(dirname "$0")/gpu_steps.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpus.txt"
BENCH=(bench/bench_services.py --models 1.5b --transport ipc --backend megatron --ipc-direction trainer_writes --reps 10)

step 70 gpu_test python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_trainer_writes_gpu.py \
  -k "services_sync_exactly and bfloat16"
show gpu_test 4
step 90 services_branch env PYTHONPATH="$PWD/bench/profile:$PYTHONPATH" WS_PROF_OUT="$OUT/prof" python3 "${BENCH[@]}" \
  --out "$OUT/services_fixed_cost_branch.json"
show services_branch 6
python3 bench/profile/summarize.py "$OUT/prof" > "$OUT/prof.txt" 2>&1; head -40 "$OUT/prof.txt"
if [ -n "${BASE:-}" ]; then
  step 90 services_base bash -c "cd '$BASE' && PYTHONPATH='$BASE':'$PYTHONPATH' python3 ${BENCH[*]} --out '$OUT/services_fixed_cost_base.json'"
  show services_base 6
fi
