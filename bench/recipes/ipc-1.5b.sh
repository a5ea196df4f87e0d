#!/usr/bin/env bash
# One GPU: 1.5B colocated IPC through the services, trainer_writes, each against one D2D copy in the same run: megatron bf16 and fp8-block, hf bf16, then megatron bf16 with both IPC directions alternating.
. "$(dirname "$0")/lib.sh"
step 200 megatron python3 -m bench services --models 1.5b --transport ipc --backend megatron \
  --export-dtypes bfloat16,fp8-block --ipc-direction trainer_writes --reps 10
show megatron 14
step 120 hf python3 -m bench services --models 1.5b --transport ipc --backend hf --ipc-direction trainer_writes --reps 10
show hf 8
step 150 directions python3 -m bench services --models 1.5b --transport ipc --backend megatron \
  --ipc-direction trainer_writes,rollout_reads --reps 10
show directions 10
