#!/usr/bin/env bash
# One GPU: the sync's kernels alone, each against a plain copy of the same bytes: the copy-and-checksum write pass (7B, 1.5B), the block-FP8 slot kernels (7B), the delta codec (torch vs fused).
. "$(dirname "$0")/lib.sh"
step 180 verified_copy python3 -m bench verified_copy
show verified_copy 25
step 150 fp8_slots python3 -m bench fp8_slots --shape 7b --reps 5 --no-narrow
show fp8_slots 25
step 200 delta_codec python3 -m bench delta_codec
show delta_codec 25
