#!/usr/bin/env bash
# Issue 33 on one GPU (H100 or H200), output under $OUT; each step fits one device call (<= 540 s):
#
#   STEP=ipc   bash bench/run_megatron_one_pass.sh  # 1.5B + 7B colocated IPC through the services, megatron
#                                                   # then hf (bf16, 10 reps), each against one D2D copy
#   STEP=tests bash bench/run_megatron_one_pass.sh  # GPU tests of the megatron export (TP=1 parity, IPC sync
#                                                   # from its own buckets) + the export's pack phase alone
#
# Wheels (megatron-core, grpcio, protobuf, ...) are installed from .whl/ as in bench/run_gpu_suite.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP=${STEP:?set STEP to ipc or tests}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpus.txt"
case "$STEP" in
  ipc) WS_LOCAL_OMP_THREADS=8 timeout 300 python3 bench/bench_services.py --models 1.5b,7b --transport ipc \
         --backend megatron --reps 10 --out "$OUT/services_ipc_megatron.json" 2>&1 | tee -a "$OUT/services_ipc.txt"
       WS_LOCAL_OMP_THREADS=8 timeout 220 python3 bench/bench_services.py --models 1.5b,7b --transport ipc \
         --backend hf --reps 10 --out "$OUT/services_ipc_hf.json" 2>&1 | tee -a "$OUT/services_ipc.txt" ;;
  tests) timeout 330 python3 -m pytest -v -s -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_megatron_gpu.py \
           tests/gpu/test_services_gpu.py -k "tp1 or megatron_bf16_trainer or ipc_bf16_trainer" 2>&1 | tee "$OUT/gpu_tests.txt"
         for m in 1.5b 7b; do
           timeout 100 python3 bench/bench_megatron_export.py --model "$m" --reps 5 \
             --out "$OUT/export_$m.json" 2>&1 | grep -v -i warn | tee -a "$OUT/export.txt"
         done ;;
  *) echo "STEP=$STEP: must be ipc or tests" >&2; exit 2 ;;
esac
