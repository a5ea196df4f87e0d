#!/usr/bin/env bash
# One GPU: 7B colocated IPC through the services, trainer_writes, each against one D2D copy of the same bytes in the same run: megatron bf16 and fp8-block (the services started once for each), then hf bf16.
. "$(dirname "$0")/lib.sh"
step 400 megatron python3 -m bench services --models 7b --transport ipc --backend megatron \
  --export-dtypes bfloat16,fp8-block --ipc-direction trainer_writes --reps 10
show megatron 14
step 170 hf python3 -m bench services --models 7b --transport ipc --backend hf --ipc-direction trainer_writes --reps 10
show hf 8
