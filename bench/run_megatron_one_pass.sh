#!/usr/bin/env bash
# Issue 33 on one GPU (H100 or H200), output under $OUT; each step fits one device call (<= 540 s):
#
#   STEP=ipc   bash bench/run_megatron_one_pass.sh  # 1.5B + 7B colocated IPC through the services, megatron
#                                                   # then hf (bf16, 10 reps), each against one D2D copy
#   STEP=tests bash bench/run_megatron_one_pass.sh  # GPU tests of the megatron export (TP=1 parity, IPC sync
#                                                   # from its own buckets) + the export's pack phase alone
#   STEP=all   bash bench/run_megatron_one_pass.sh  # one call, at most LIMIT s (default 560): the copy kernel's
#                                                   # GPU test, megatron and hf at 7B then 1.5B (bf16, 10 reps,
#                                                   # each with bench/profile/ timing both services, summarized
#                                                   # in the log), then the megatron IPC GPU test, while time lasts.
#                                                   # A 7B run through the services takes more than 120 s (start-up:
#                                                   # both services fill 7B random weights on the CPU): at LIMIT=255
#                                                   # (2026-11-25) both 7B runs were cut off before their results
#
# Wheels (megatron-core, grpcio, protobuf, ...) are installed from .whl/ as in bench/run_gpu_suite.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP=${STEP:?set STEP to ipc, tests or all}
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
  all) # in order of value, each step bounded by what is left of LIMIT seconds (default 560) so that
       # a call that runs out still returns the steps before: JSON straight into $OUT, the rest in the log
       LIMIT=${LIMIT:-560}
       step() { local t=$1; shift; local left=$((LIMIT - SECONDS - 5)); [ "$left" -lt 20 ] && { echo "== skipped (time): $*"; return; }
                [ "$t" -gt "$left" ] && t=$left; timeout "$t" "$@"; }
       step 60 python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_copy_runs_gpu.py 2>&1 | tail -5
       for run in megatron:7b hf:7b megatron:1.5b hf:1.5b; do
         b=${run%%:*}; m=${run#*:}; P=/tmp/prof_${b}_$m; mkdir -p $P
         PYTHONPATH=$PWD/bench/profile:$PYTHONPATH WS_PROF_OUT=$P WS_LOCAL_OMP_THREADS=8 \
           step 240 python3 bench/bench_services.py --models $m --transport ipc --backend $b --reps 10 \
           --out "$OUT/services_ipc_${b}_$m.json" 2>&1 | grep -v -i warn
         sleep 2.5; echo "== profile $b $m"; python3 bench/profile/summarize.py $P | head -45
       done
       step 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_services_gpu.py \
         -k megatron_bf16_trainer 2>&1 | tail -5
       echo "== total ${SECONDS}s" ;;
  *) echo "STEP=$STEP: must be ipc, tests or all" >&2; exit 2 ;;
esac
