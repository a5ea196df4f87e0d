#!/usr/bin/env bash
# The GPU measurements that the open work waits for, in bounded device calls (each <= LIMIT s, default 560);
# output under $OUT: result JSONs, and every step's whole log in $OUT/logs.tar.gz (kept whatever stops the call).
#
#   PART=a bash bench/run_pending_gpu.sh   # one GPU: the GPU tests of the new kernels (trainer writes, fused FP8
#                                          # slots, fused delta codec, token streaming), then megatron 7B and 1.5B
#                                          # colocated IPC with both directions alternating in the same services,
#                                          # then the delta codec's torch-vs-Triton rates
#   PART=b bash bench/run_pending_gpu.sh   # one GPU: megatron 7B and 1.5B, bf16 and fp8-block in the same run
#                                          # (the fused FP8 path: its stream.export should be ~0), then hf 7B
#                                          # trainer_writes
#   PART=c bash bench/run_pending_gpu.sh   # two GPUs: full vs delta over NCCL at 1.5B (plain, then with P2P and
#                                          # SHM off: a slower link), the NCCL delta GPU tests, then each stage
#                                          # of a 7B PP=2 trainer: its own buckets in place vs export + pack
#   PART=d bash bench/run_pending_gpu.sh   # four GPUs (last: not always lent): PP=2 multi-sender over NCCL, full
#                                          # then sync_encoding=delta (each stage frames its own deltas), timed
#   PART=e bash bench/run_pending_gpu.sh   # two GPUs: the TP=2 flat export over NCCL (its GPU test, then a 7B
#                                          # TP=2 stage leader's flat buckets vs its export + pack)
#   PART=f bash bench/run_pending_gpu.sh   # two GPUs: the copy kernel's cast and the TP=2 flat export's GPU
#                                          # tests, the 7B TP=2 and PP=2 flat exports again (exact on random
#                                          # bits), then full vs delta over NCCL at 1.5B in the trainer's 1 GiB
#                                          # buckets (part c used 16 MiB), plain and with P2P and SHM off
#   PART=g bash bench/run_pending_gpu.sh   # two GPUs: what sync_encoding=auto picks over NCCL at 1.5B, by the rate it
#                                          # measures (NVLink: full, no base; P2P and SHM off: delta), then its GPU test
#   PART=h bash bench/run_pending_gpu.sh   # one GPU: the trainer-writes, copy-and-checksum, FP8 slot and stream GPU
#                                          # tests, megatron 7B and 1.5B colocated IPC in both directions, then the
#                                          # built-in engine under 16 concurrent requests against one at a time
#   PART=i bash bench/run_pending_gpu.sh   # one GPU: block-FP8 trainer_writes (its GPU tests and the fused
#                                          # kernel's microbench), then megatron 7B and 1.5B, bf16 and fp8-block,
#                                          # both writing into the engine, in the same services
#   PART=k bash bench/run_pending_gpu.sh   # one GPU: megatron 7B only, bf16 then fp8-block, both trainer_writes, in
#                                          # the same services (PART=i's step ran out during 1.5B: ~90 s a start)
#   PART=l bash bench/run_pending_gpu.sh   # one GPU: the FP8 kernels with the GPU's conversions (their GPU tests
#                                          # against the bit arithmetic, the kernels' microbench with
#                                          # WS_FP8_GPU_CONVERT=0 then 1), then PART=k's 7B services run,
#                                          # then 1.5B bf16 and fp8-block with the syncs profiled
#                                          # (WS_PROFILE_SYNCS: host time by function; slower syncs)
#   PART=m bash bench/run_pending_gpu.sh   # one GPU: the hf trainer's 7B and 1.5B trainer_writes
#
# Each step is bounded by its own limit and by what is left of LIMIT, so a call that runs out keeps what ran.
# The GPU hosts have no network: megatron-core, grpcio, protobuf and the HTTP stack travel as wheels in .whl/
# (docs/BENCHMARKS.md) and are installed into /tmp/site here.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} WS_LOCAL_OMP_THREADS=${WS_LOCAL_OMP_THREADS:-8}
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$LOGS"
LIMIT=${LIMIT:-560}
PART=${PART:?set PART to a, b, c, d, e, f, g, h, i, k, l or m}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
. "$(dirname "$0")/gpu_steps.sh"
PYTEST=(python3 -m pytest -v -s -m gpu -p no:cacheprovider -o addopts="")
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1 2>/dev/null;
  python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__)"; } \
  | tee "$LOGS/gpus.txt"
day=$(date -u +%F)

case "$PART" in
  a) step 170 gpu_tests "${PYTEST[@]}" tests/gpu/test_trainer_writes_gpu.py tests/gpu/test_fp8_slots_gpu.py \
       tests/gpu/test_delta_gpu_codec.py tests/gpu/test_stream_gpu.py
     show gpu_tests 25
     step 250 services_megatron python3 bench/bench_services.py --models 7b,1.5b --transport ipc --backend megatron \
       --ipc-direction trainer_writes,rollout_reads --reps 10 --out "$OUT/results_services_ipc_megatron_$day.json"
     show services_megatron 14
     step 150 delta_codec python3 bench/bench_delta_gpu_codec.py --configs 4096x8,2048x16,4096x16,1024x8 \
       --out "$OUT/results_delta_gpu_codec_$day.json"
     show delta_codec 30 ;;
  b) step 330 services_fp8 python3 bench/bench_services.py --models 7b,1.5b --transport ipc --backend megatron \
       --export-dtypes bfloat16,fp8-block --reps 10 --out "$OUT/results_services_ipc_fp8_megatron_$day.json"
     show services_fp8 20
     step 200 services_hf python3 bench/bench_services.py --models 7b --transport ipc --backend hf \
       --ipc-direction trainer_writes --reps 10 --out "$OUT/results_services_ipc_hf_$day.json"
     show services_hf 8 ;;
  c) step 200 delta_nccl python3 bench/bench_delta_nccl.py --shape 1.5b --reps 3 \
       --out "$OUT/results_delta_nccl_1.5b_$day.json"
     show delta_nccl 20
     step 200 delta_nccl_slow env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 python3 bench/bench_delta_nccl.py --shape 1.5b \
       --reps 3 --out "$OUT/results_delta_nccl_1.5b_noP2P_$day.json"
     show delta_nccl_slow 20
     step 150 gpu_tests_nccl_delta "${PYTEST[@]}" tests/gpu/test_nccl_delta_gpu.py
     show gpu_tests_nccl_delta 15
     step 150 flat_pp python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/bench_flat_pp.py \
       --model 7b --pp 2 --reps 5 --out "$OUT/results_flat_pp_7b_$day.json"
     show flat_pp 12 ;;
  d) step 540 gpu_tests_multisender env OMP_NUM_THREADS=4 WS_BENCH_OUT="$OUT/results_nccl_multisender_delta_$day" \
       "${PYTEST[@]}" tests/gpu/test_multisender_gpu.py -k over_nccl
     show gpu_tests_multisender 25 ;;
  e) step 150 gpu_tests_flat_tp "${PYTEST[@]}" tests/gpu/test_flat_export_tp_gpu.py
     show gpu_tests_flat_tp 10
     step 200 flat_tp2 python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/bench_flat_pp.py \
       --model 7b --tp 2 --pp 1 --reps 5 --out "$OUT/results_flat_tp2_7b_$day.json"
     show flat_tp2 12 ;;
  f) step 120 gpu_tests_copy "${PYTEST[@]}" tests/gpu/test_copy_runs_gpu.py tests/gpu/test_flat_export_tp_gpu.py
     show gpu_tests_copy 12
     step 130 flat_tp2 python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/bench_flat_pp.py \
       --model 7b --tp 2 --pp 1 --reps 5 --out "$OUT/results_flat_tp2_7b_$day.json"
     show flat_tp2 4
     step 80 flat_pp python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/bench_flat_pp.py \
       --model 7b --pp 2 --reps 5 --out "$OUT/results_flat_pp_7b_$day.json"
     show flat_pp 4
     step 90 delta_nccl_1g python3 bench/bench_delta_nccl.py --shape 1.5b --reps 3 --bucket-mb 1024 \
       --out "$OUT/results_delta_nccl_1.5b_1g_$day.json"
     show delta_nccl_1g 5
     step 100 delta_nccl_1g_slow env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 python3 bench/bench_delta_nccl.py \
       --shape 1.5b --reps 3 --bucket-mb 1024 --out "$OUT/results_delta_nccl_1.5b_1g_noP2P_$day.json"
     show delta_nccl_1g_slow 5 ;;
  g) step 120 gpu_tests_auto "${PYTEST[@]}" tests/gpu/test_nccl_delta_gpu.py -k auto_decides
     show gpu_tests_auto 10
     step 200 auto_slow env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 python3 bench/bench_delta_nccl.py --shape 1.5b \
       --bucket-mb 1024 --auto 6 --out "$OUT/results_delta_nccl_auto_1.5b_noP2P_$day.json"
     show auto_slow 12
     step 200 auto_nvlink python3 bench/bench_delta_nccl.py --shape 1.5b --bucket-mb 1024 --auto 6 \
       --out "$OUT/results_delta_nccl_auto_1.5b_$day.json"
     show auto_nvlink 12 ;;
  h) step 200 gpu_tests "${PYTEST[@]}" tests/gpu/test_trainer_writes_gpu.py tests/gpu/test_verified_copy_gpu.py \
       tests/gpu/test_fp8_slots_gpu.py tests/gpu/test_stream_gpu.py
     show gpu_tests 25
     step 250 services_megatron python3 bench/bench_services.py --models 7b,1.5b --transport ipc --backend megatron \
       --ipc-direction trainer_writes,rollout_reads --reps 10 --out "$OUT/results_services_ipc_megatron_$day.json"
     show services_megatron 14
     step 120 builtin_concurrency python3 bench/bench_builtin_concurrency.py --device cuda:0
     show builtin_concurrency 30 ;;
  i) step 150 gpu_tests "${PYTEST[@]}" tests/gpu/test_trainer_writes_gpu.py -k fp8 tests/gpu/test_builtin_threads_gpu.py
     show gpu_tests 25
     step 100 fp8_kernels python3 bench/bench_fp8_slots.py --shape 7b --reps 5 --no-narrow \
       --out "$OUT/results_fp8_slots_$day.json"
     show fp8_kernels 25
     step 300 services_fp8_tw python3 bench/bench_services.py --models 7b,1.5b --transport ipc --backend megatron \
       --export-dtypes bfloat16,fp8-block --ipc-direction trainer_writes --reps 10 \
       --out "$OUT/results_services_ipc_fp8_tw_megatron_$day.json"
     show services_fp8_tw 20 ;;
  k) step 540 services_fp8_tw python3 bench/bench_services.py --models 7b --transport ipc --backend megatron \
       --export-dtypes bfloat16,fp8-block --ipc-direction trainer_writes --reps 10 \
       --out "$OUT/results_services_ipc_fp8_tw_megatron_7b_$day.json"
     show services_fp8_tw 12 ;;
  l) step 150 gpu_tests "${PYTEST[@]}" tests/gpu/test_fp8_gpu_conversions.py tests/gpu/test_fp8_slots_gpu.py \
       tests/gpu/test_trainer_writes_gpu.py::test_the_fused_fp8_write_kernel_is_quantize_then_dequantize_compiled
     show gpu_tests 25
     for cvt in 0 1; do
       step 80 "fp8_kernels_cvt$cvt" env WS_FP8_GPU_CONVERT=$cvt python3 bench/bench_fp8_slots.py --shape 7b --reps 5 \
         --no-narrow --out "$OUT/results_fp8_slots_cvt${cvt}_$day.json"
       show "fp8_kernels_cvt$cvt" 25
     done
     step 260 services_fp8_tw python3 bench/bench_services.py --models 7b --transport ipc --backend megatron \
       --export-dtypes bfloat16,fp8-block --ipc-direction trainer_writes --reps 10 \
       --out "$OUT/results_services_ipc_fp8_tw_megatron_7b_$day.json"
     show services_fp8_tw 12
     step 150 services_profiled env WS_PROFILE_SYNCS="$OUT/sync_profile_1.5b" python3 bench/bench_services.py \
       --models 1.5b --transport ipc --backend megatron --export-dtypes bfloat16,fp8-block \
       --ipc-direction trainer_writes --reps 10 --out "$OUT/results_services_profiled_1.5b_$day.json"
     show services_profiled 10 ;;
  m) step 250 services_hf python3 bench/bench_services.py --models 7b,1.5b --transport ipc --backend hf \
       --ipc-direction trainer_writes --reps 10 --out "$OUT/results_services_ipc_hf_tw_$day.json"
     show services_hf 10 ;;
  *) echo "PART=$PART: must be a, b, c, d, e, f, g, h, i, k, l or m" >&2; exit 2 ;;
esac
echo "== total ${SECONDS}s"
