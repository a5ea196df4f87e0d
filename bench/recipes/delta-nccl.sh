#!/usr/bin/env bash
# Two GPUs: full vs delta syncs over NCCL at 1.5B in the trainer's 1 GiB buckets, over NVLink and over NCCL's socket transport (P2P and SHM off: a slower link), then what sync_encoding=auto picks on the slow link.
. "$(dirname "$0")/lib.sh"
step 150 nvlink python3 -m bench delta_nccl --shape 1.5b --reps 3 --bucket-mb 1024
show nvlink 5
step 170 socket env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 python3 -m bench delta_nccl --shape 1.5b --reps 3 --bucket-mb 1024
show socket 5
step 200 auto_socket env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 python3 -m bench delta_nccl --shape 1.5b \
  --bucket-mb 1024 --auto 6
show auto_socket 12
