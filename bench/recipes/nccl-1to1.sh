#!/usr/bin/env bash
# Two GPUs: 1.5B and 7B over NCCL through the services (trainer cuda:0, rollout cuda:1), hf then megatron, each against a raw NCCL broadcast of the same bytes in the same run.
. "$(dirname "$0")/lib.sh"
for backend in hf megatron; do
  step 270 "nccl_$backend" python3 -m bench services --models 1.5b,7b --transport nccl --backend "$backend" --reps 5
  show "nccl_$backend" 10
done
