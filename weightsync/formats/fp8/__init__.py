"""Block-scaled FP8 (e4m3, 128x128 blocks): the format, its kernels and the paths that write it.

The format:
- `spec`: the scheme as data (constants, how a manifest and an HF config name it);
- `blocks`: a tensor quantized / dequantized block by block (the torch reference, and the dispatch
  to `blocks_triton` on a CUDA GPU);
- `export`: which exported tensors travel as FP8, and the trainer's exported stream in that format;
- `receive`: the rollout's side: a manifest's weight/scale pairs checked, a tensor stream dequantized.

The bucket paths, each a planner with its Triton launch beside it (`<name>_triton`):
- `quantize_slots`: the trainer quantizes weights straight into its bucket slots;
- `dequantize_slots`: the rollout dequantizes a received bucket straight into its engine's parameters;
- `write_slots`: the trainer writes into a colocated engine that dequantizes (quantize and dequantize in
  one pass; only the codes' sums are kept), and `trainer_writes`, that sync's sender.

The arithmetic every kernel shares: `quantize_triton` (a block's scale, the e4m3 rounding) and
`dequantize_triton` (the e4m3 decode, the bfloat16 rounding), one definition each, bit for bit the
torch path's. `warm` compiles the kernels at start-up instead of in the first FP8 sync.
"""
