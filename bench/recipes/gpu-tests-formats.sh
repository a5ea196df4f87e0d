#!/usr/bin/env bash
# One GPU (two for the NCCL tests, skipped otherwise): the GPU tests of the formats and trainers: FP8 kernels and slots, the delta codec, megatron parity, torch_dist, TP flat export.
. "$(dirname "$0")/lib.sh"
step 540 gpu_tests "${PYTEST[@]}" tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_gpu_conversions.py \
  tests/gpu/test_fp8_slots_gpu.py tests/gpu/test_delta_gpu_codec.py tests/gpu/test_megatron_gpu.py \
  tests/gpu/test_torch_dist_gpu.py tests/gpu/test_flat_export_tp_gpu.py
show gpu_tests 30
