"""A received block-FP8 bucket into the engine's parameters in one Triton launch, checksummed as it goes.

Two kinds of programs share the launch (fp8_dequant_slots.py builds their tables once per layout):
- word programs, one per row of the word table (first word of the bucket, word count, destination
  word or none): they sum the bucket's 32-bit words for `ws-sum64-v1` and copy the 16-bit tensors'
  words (embeddings, norms, biases) into their parameters, as checksum_cuda.scatter_sum64 does;
- block programs, one per 128x128 block of an FP8 weight: they decode its e4m3 bytes, multiply by
  the block's scale (from this bucket, or from a held copy when the scale came in the bucket
  before), write the product rounded once to the parameter's dtype, and sum the block's own words
  (a weight whose rows are whole words; otherwise its words are the word programs').
The decode and the rounding are fp8_triton.dequant_block's (bit for bit the torch path's). Every
address is an element offset from a base tensor the launch passes, as in copy_runs_cuda.py.
"""

from __future__ import annotations

import functools

import torch

from weightsync.formats.fp8_spec import BLOCK
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

WORD_BLOCK = 4096
WORD_STEPS = 16
WORDS_PER_ROW = WORD_BLOCK * WORD_STEPS
WORD_FIELDS = 4  # first word, count, destination word, has a destination
#: rows, cols, e4m3 byte offset, scale in this bucket, scale offset (float32 elements), destination
#: offset (elements of its dtype), first block program, output float32, sums its own words
TENSOR_FIELDS = 9


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    # the word-program count differs per bucket: not a specialisation (one compile serves every bucket)
    @triton.jit(do_not_specialize=["n_word"])
    def dequant_bucket(
        buf_bytes,
        buf_words,
        buf_f32,
        word_base,
        bf16_base,
        f32_base,
        word_ptr,
        n_word,
        tensor_ptr,
        owner_ptr,
        out_ptr,
        WB: tl.constexpr,
        WS: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        if pid < n_word:
            src = tl.load(word_ptr + pid * 4)
            n = tl.load(word_ptr + pid * 4 + 1)
            dst = tl.load(word_ptr + pid * 4 + 2)
            has_dst = tl.load(word_ptr + pid * 4 + 3)
            acc1 = tl.zeros([WB], dtype=tl.int64)
            acc2 = tl.zeros([WB], dtype=tl.int64)
            for i in range(WS):
                offs = i * WB + tl.arange(0, WB)
                mask = offs < n
                w = tl.load(buf_words + src + offs, mask=mask, other=0)
                tl.store(word_base + dst + offs, w, mask=mask & (has_dst != 0))
                acc1 += w.to(tl.int64)
                acc2 += (w * w).to(tl.int64)  # the square wraps in int32, as checksum.py's
            tl.store(out_ptr + pid * 2, tl.sum(acc1, axis=0))
            tl.store(out_ptr + pid * 2 + 1, tl.sum(acc2, axis=0))
        else:
            t = tl.load(owner_ptr + (pid - n_word)).to(tl.int64) * 9
            rows = tl.load(tensor_ptr + t)
            cols = tl.load(tensor_ptr + t + 1)
            q_off = tl.load(tensor_ptr + t + 2)
            s_here = tl.load(tensor_ptr + t + 3)
            s_off = tl.load(tensor_ptr + t + 4)
            d_off = tl.load(tensor_ptr + t + 5)
            k = pid - n_word - tl.load(tensor_ptr + t + 6)
            out_f32 = tl.load(tensor_ptr + t + 7)
            sums = tl.load(tensor_ptr + t + 8)
            n_cb = (cols + BC - 1) // BC
            c0 = (k % n_cb) * BC
            r = (k // n_cb) * BR + tl.arange(0, BR).to(tl.int64)
            c = c0 + tl.arange(0, BC).to(tl.int64)
            rmask = r < rows
            mask = rmask[:, None] & (c[None, :] < cols)
            offs = r[:, None] * cols + c[None, :]
            code = tl.load(buf_bytes + q_off + offs, mask=mask, other=0).to(tl.int32)
            if s_here != 0:
                s = tl.load(buf_f32 + s_off + k)
            else:
                s = tl.load(f32_base + s_off + k)
            # from here to the product: fp8_triton.dequant_block's arithmetic
            e = (code >> 3) & 0xF
            m = code & 0x7
            normal = ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
            v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
            v = tl.where((code & 0x7F) == 0x7F, float("nan"), v)
            v = (v.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)
            prod = v * s
            if out_f32 != 0:
                tl.store(f32_base + d_off + offs, prod, mask=mask)
            else:
                bits = prod.to(tl.uint32, bitcast=True)
                half = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                tl.store(bf16_base + d_off + offs, half.to(tl.int16), mask=mask)
            # the block's own words (rows of whole words: cols and q_off multiples of 4)
            j = tl.arange(0, BC // 4).to(tl.int64)
            wmask = rmask[:, None] & (c0 + 4 * j[None, :] < cols) & (sums != 0)
            widx = (q_off + r[:, None] * cols + c0) // 4 + j[None, :]
            w = tl.load(buf_words + widx, mask=wmask, other=0)
            tl.store(out_ptr + pid * 2, tl.sum(tl.sum(w.to(tl.int64), axis=1), axis=0))
            tl.store(out_ptr + pid * 2 + 1, tl.sum(tl.sum((w * w).to(tl.int64), axis=1), axis=0))

    return dequant_bucket


def launch(buf: torch.Tensor, bases: tuple[torch.Tensor, ...], words: torch.Tensor, tensors, owners) -> torch.Tensor:
    """Run one bucket (`buf`, flat uint8 holding at least every word the tables name) with the tables
    `words` (int64 [rows, WORD_FIELDS]), `tensors` (int64 [n, TENSOR_FIELDS]) and `owners` (int32, one
    per block program); `bases` = (int32, int16, float32) base tensors of the destination offsets.
    Returns int64 [2], the word sums of every word the tables cover."""
    whole = buf.numel() - buf.numel() % 4
    n_word = words.shape[0]
    programs = n_word + owners.numel()
    partial = torch.zeros(max(programs, 1) * 2, dtype=torch.int64, device=buf.device)
    if programs == 0:
        return partial.view(-1, 2).sum(dim=0)
    word_base, bf16_base, f32_base = bases
    args = (buf, buf[:whole].view(torch.int32), buf[:whole].view(torch.float32), word_base, bf16_base, f32_base)
    consts = dict(WB=WORD_BLOCK, WS=WORD_STEPS, BR=BLOCK[0], BC=BLOCK[1])
    grid = (programs,)
    if buf.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        _kernel()[grid](*args, words, n_word, tensors, owners, partial, **consts)
    else:
        with torch.cuda.device(buf.device):
            _kernel()[grid](*args, words, n_word, tensors, owners, partial, **consts, num_warps=8)
    return partial.view(-1, 2).sum(dim=0)
