#!/usr/bin/env bash
# One device call: GPU tests (bus + megatron), then the sync benchmark. Output under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m | tee -a "$OUT/gpus.txt"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt"
timeout ${BENCH_TIMEOUT:-330} python3 bench/bench_sync.py --models ${MODELS:-0.5b,7b,32b} --reps ${REPS:-3} --out "$OUT/bench_sync.json" 2>&1 | tee "$OUT/bench.txt"
