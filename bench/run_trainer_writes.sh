#!/usr/bin/env bash
# CUDA IPC with the trainer writing into the engine (weightsync/bus/ipc/trainer_writes.py), one GPU, one call:
# its GPU tests, then bench_services at 7B and 1.5B with the megatron trainer and at 7B with the hf trainer
# (ipc_direction auto = trainer_writes; 10 reps each, each against one D2D copy in the same run), each
# step bounded by what is left of LIMIT seconds (default 440) so a call that runs out keeps what ran.
#
#   OUT=/tmp/out bash bench/run_trainer_writes.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-440}
step() { local t=$1; shift; local left=$((LIMIT - SECONDS - 5)); [ "$left" -lt 20 ] && { echo "== skipped (time): $*"; return; }
         [ "$t" -gt "$left" ] && t=$left; echo "== $(date -u +%H:%M:%S) ${t}s: $*"; timeout "$t" "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
step 90 python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_trainer_writes_gpu.py \
  -k "not megatron" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
WS_LOCAL_OMP_THREADS=8 step 230 python3 bench/bench_services.py --models 7b,1.5b --transport ipc --backend megatron \
  --reps 10 --out "$OUT/services_ipc_megatron.json" 2>&1 | grep -v -i warn | tail -40
WS_LOCAL_OMP_THREADS=8 step 130 python3 bench/bench_services.py --models 7b --transport ipc --backend hf \
  --reps 10 --out "$OUT/services_ipc_hf.json" 2>&1 | grep -v -i warn | tail -25
step 120 python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_trainer_writes_gpu.py \
  -k megatron 2>&1 | tee -a "$OUT/gpu_tests.txt" | tail -8
echo "== total ${SECONDS}s"
