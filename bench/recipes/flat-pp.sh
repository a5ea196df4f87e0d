#!/usr/bin/env bash
# Two GPUs: a 7B pipeline stage (PP=2) and a TP=2 stage leader, their own flat buckets against export + pack.
. "$(dirname "$0")/lib.sh"
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m bench flat_pp)
step 200 pp2 "${TORCHRUN[@]}" --model 7b --pp 2 --reps 5
show pp2 12
step 200 tp2 "${TORCHRUN[@]}" --model 7b --tp 2 --pp 1 --reps 5
show tp2 12
