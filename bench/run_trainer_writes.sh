#!/usr/bin/env bash
# CUDA IPC with the trainer writing into the engine (weightsync/bus/ipc/trainer_writes.py), one GPU, one call:
#   1. the GPU tests of the write pass (the one launch for all buckets against one launch per bucket; two
#      processes with real IPC handles);
#   2. bench_services, megatron trainer, 7B and 1.5B, trainer_writes AND rollout_reads in the same services
#      (warmed up once each, then their 10 timed syncs alternate: each the other's baseline), each against
#      one D2D copy of the bytes in the same run;
#   3. bench_services, hf trainer, 7B, trainer_writes;
#   4. the rest of the GPU tests (services, hf and megatron trainers), if time is left.
# Each step is bounded by what is left of LIMIT seconds (default 420), so a call that runs out keeps what
# ran; every step's whole output and the services' logs of a failed bench end up in $OUT/logs.tar.gz, the
# result JSONs beside it.
#
#   OUT=/tmp/out CODE=$(git rev-parse --short HEAD) bash bench/run_trainer_writes.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export WS_LOCAL_OMP_THREADS=${WS_LOCAL_OMP_THREADS:-8}
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$LOGS"
LIMIT=${LIMIT:-420}
PYTEST=(python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_trainer_writes_gpu.py)
. "$(dirname "$0")/gpu_steps.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; echo "code: ${CODE:-(set CODE=<commit>)}"; } \
  | tee "$LOGS/gpus.txt"

step 60 gpu_tests_write_pass "${PYTEST[@]}" -k "at_once or across_processes"; show gpu_tests_write_pass 8
step 230 services_megatron python3 bench/bench_services.py --models 7b,1.5b --transport ipc --backend megatron \
  --ipc-direction trainer_writes,rollout_reads --reps 10 --out "$OUT/services_ipc_megatron.json"
show services_megatron 14
step 170 services_hf python3 bench/bench_services.py --models 7b --transport ipc --backend hf \
  --ipc-direction trainer_writes --reps 10 --out "$OUT/services_ipc_hf.json"
show services_hf 8
step 120 gpu_tests_services "${PYTEST[@]}" -k "not at_once and not across_processes"; show gpu_tests_services 8
echo "== total ${SECONDS}s"
