#!/usr/bin/env bash
# Two GPUs: the bus alone (no services), 7B and 32B over NCCL and 7B over CUDA IPC, against a raw broadcast and a D2D copy of the same bytes.
. "$(dirname "$0")/lib.sh"
step 540 bus python3 -m bench bus --models 7b,32b --bucket-mb 1024 --reps 3 --ipc-models 7b
show bus 30
