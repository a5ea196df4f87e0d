"""A received block-FP8 bucket into the engine's parameters in one Triton launch, checksummed as it goes.

Two kinds of programs share the launch (dequantize_slots.py builds their tables once per layout):
- word programs, one per row of the word table (first word of the bucket, word count, destination
  word or none): they sum the bucket's 32-bit words for `ws-sum64-v1` and copy the 16-bit tensors'
  words (embeddings, norms, biases) into their parameters, as checksum_triton.scatter_sum64 does;
- block programs, one per 32 rows x 128 columns (TILE_ROWS) of an FP8 weight: they decode its e4m3
  bytes, multiply by their 128x128 block's scale (from this bucket, or from a held copy when the
  scale came in the bucket before), write the product rounded once to the parameter's dtype, and
  sum their own words (a weight whose rows are whole words; otherwise its words are the word
  programs').
The decode and the rounding are the per-tensor dequantize's (dequantize_triton.py: one definition,
bit for bit the torch path's). Every
address is an element offset from a base tensor the launch passes, as in copy/copy_runs_triton.py.
Each launch carries the widest access its tensor table allows (VEC elements: 16 for a real model's
layout) and each word run whether it can move 4 words at once; the kernel tells the compiler by
multiplying the offsets back by them. Without, every access moved one element, with ~255 registers
a thread (quantize_slots_triton.py says why this matters: ~10x).
"""

from __future__ import annotations

import torch

from weightsync.formats.fp8.spec import BLOCK
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

WORD_BLOCK = 1024  # words per step of a word program: 8 a thread at NUM_WARPS = 4 (~60 registers)
WORD_STEPS = 32
#: rows of an FP8 weight per block program (a quarter of its scale's 128 x 128 block), and warps
TILE_ROWS = 32
NUM_WARPS = 4
WORDS_PER_ROW = WORD_BLOCK * WORD_STEPS
#: first word, count, destination word, has a destination, wide (the first three multiples of MAX_WV)
WORD_FIELDS = 5
#: rows, cols, e4m3 byte offset, scale in this bucket, scale offset (float32 elements), destination
#: offset (elements of its dtype), first block program, output float32, sums its own words
TENSOR_FIELDS = 9
#: the widest accesses: 4 words (16 bytes), 16 elements (16 e4m3 bytes, 32 bytes of bf16)
MAX_WV, MAX_VEC = 4, 16


def widest(limit: int, values) -> int:
    """The largest power of two up to `limit` that divides every one of `values`."""
    v = limit
    for x in values:
        while x % v:
            v //= 2
    return v


def _kernel():
    from weightsync.formats.fp8.dequantize_triton import dequant_bucket

    return dequant_bucket


def launch(
    buf: torch.Tensor, bases: tuple[torch.Tensor, ...], words: torch.Tensor, tensors, owners, vec: int
) -> torch.Tensor:
    """Run one bucket (`buf`, flat uint8 holding at least every word the tables name) with the tables
    `words` (int64 [rows, WORD_FIELDS]), `tensors` (int64 [n, TENSOR_FIELDS]) and `owners` (int32, one
    per block program); `bases` = (int32, int16, float32) base tensors of the destination offsets;
    `vec` divides every column count and element offset of `tensors` (`widest`). Returns int64 [2],
    the word sums of every word the tables cover."""
    whole = buf.numel() - buf.numel() % 4
    n_word = words.shape[0]
    programs = n_word + owners.numel()
    partial = torch.zeros(max(programs, 1) * 2, dtype=torch.int64, device=buf.device)
    if programs == 0:
        return partial.view(-1, 2).sum(dim=0)
    word_base, bf16_base, f32_base = bases
    args = (buf, buf[:whole].view(torch.int32), buf[:whole].view(torch.float32), word_base, bf16_base, f32_base)
    consts = dict(WB=WORD_BLOCK, WS=WORD_STEPS, BR=BLOCK[0], BC=BLOCK[1], RB=TILE_ROWS, VEC=vec, WV=MAX_WV)
    grid = (programs,)
    if buf.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        _kernel()[grid](*args, words, n_word, tensors, owners, partial, **consts)
    else:
        with torch.cuda.device(buf.device):
            _kernel()[grid](*args, words, n_word, tensors, owners, partial, **consts, num_warps=NUM_WARPS)
    return partial.view(-1, 2).sum(dim=0)
