#!/usr/bin/env bash
# GPU work in steps that each fit one device call (10 minutes at most); output under $OUT. The runs that
# docs/BENCHMARKS.md cites are copied from there into bench/results/ (results_*.json, gpu_tests_*.txt).
#
#   STEP=tests-a bash bench/run_gpu_suite.sh   # GPU tests, first half (bus, services, IPC, multi-sender, FP8 sync)
#   STEP=tests-b bash bench/run_gpu_suite.sh   # GPU tests, second half (megatron parity, torch_dist, FP8 kernels)
#   STEP=ipc     bash bench/run_gpu_suite.sh   # 1 GPU: 7B colocated IPC through the services, hf and megatron
#   STEP=nccl    bash bench/run_gpu_suite.sh   # 2 GPUs: 1.5B/7B NCCL through the services against a raw broadcast
#   STEP=bus     bash bench/run_gpu_suite.sh   # 2 GPUs: the bus alone, 7B/32B, against a raw broadcast
#
# The GPU hosts have no network: megatron-core, grpcio, protobuf and the HTTP stack travel as wheels
# in .whl/ (see docs/BENCHMARKS.md) and are installed into /tmp/site here.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP=${STEP:?set STEP to one of tests-a tests-b ipc nccl bus}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpus.txt"
T=${STEP_TIMEOUT:-560}
pytest_gpu() { timeout "$T" python3 -m pytest -v -s -m gpu -p no:cacheprovider -o addopts="" "$@"; }
case "$STEP" in
  tests-a) pytest_gpu tests/gpu/test_multisender_gpu.py tests/gpu/test_nccl_multisender_gpu.py tests/gpu/test_services_gpu.py \
             tests/gpu/test_bus_gpu.py tests/gpu/test_copy_runs_gpu.py tests/gpu/test_fp8_gpu.py -k "not triton_quantizer_equals" 2>&1 | tee "$OUT/gpu_tests_a.txt" ;;
  tests-b) pytest_gpu tests/gpu/test_megatron_gpu.py tests/gpu/test_torch_dist_gpu.py tests/gpu/test_fp8_gpu.py \
             -k "not tp1-float32" 2>&1 | tee "$OUT/gpu_tests_b.txt" ;;
  ipc) for backend in hf megatron; do
         WS_LOCAL_OMP_THREADS=4 timeout $((T / 2)) python3 bench/bench_services.py --models 7b --transport ipc \
           --backend "$backend" --reps 10 --out "$OUT/services_ipc_$backend.json" 2>&1 | tee -a "$OUT/services_ipc.txt"
       done ;;
  nccl) for backend in hf megatron; do
          WS_LOCAL_OMP_THREADS=4 timeout $((T / 2)) python3 bench/bench_services.py --models 1.5b,7b --transport nccl \
            --backend "$backend" --reps 5 --out "$OUT/services_nccl_$backend.json" 2>&1 | tee -a "$OUT/services_nccl.txt"
        done ;;
  bus) timeout "$T" python3 bench/bench_sync.py --models 7b,32b --bucket-mb 1024 --reps 3 --ipc-models 7b \
         --out "$OUT/bench_sync.json" 2>&1 | tee "$OUT/bench_sync.txt" ;;
  *) echo "STEP=$STEP: must be one of tests-a tests-b ipc nccl bus" >&2; exit 2 ;;
esac
