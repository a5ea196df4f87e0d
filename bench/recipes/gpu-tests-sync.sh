#!/usr/bin/env bash
# One GPU (two for the NCCL tests, skipped otherwise): the GPU tests of the sync paths: bus, services, trainer writes, copy kernels, builtin engine threads, streaming.
. "$(dirname "$0")/lib.sh"
step 540 gpu_tests "${PYTEST[@]}" tests/gpu/test_bus_gpu.py tests/gpu/test_services_gpu.py \
  tests/gpu/test_trainer_writes_gpu.py tests/gpu/test_verified_copy_gpu.py tests/gpu/test_copy_runs_gpu.py \
  tests/gpu/test_builtin_threads_gpu.py tests/gpu/test_stream_gpu.py
show gpu_tests 30
