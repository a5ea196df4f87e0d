#!/usr/bin/env bash
# Two to four GPUs: the GPU tests that need several: NCCL delta, multi-sender (PP=2 over NCCL, full and delta).
. "$(dirname "$0")/lib.sh"
step 540 gpu_tests env OMP_NUM_THREADS=4 "${PYTEST[@]}" tests/gpu/test_nccl_delta_gpu.py \
  tests/gpu/test_multisender_gpu.py tests/gpu/test_nccl_multisender_gpu.py
show gpu_tests 30
