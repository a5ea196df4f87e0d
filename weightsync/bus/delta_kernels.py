"""The Triton kernels of the fused delta codec (delta_cuda.py says what each does and why).

Imported only by delta_cuda, lazily: triton comes with CUDA builds of torch, not the CPU build.
Each program takes a block of BLOCK words as a [BLOCK // 8, 8] tile: row r holds the 8 words of
bitmap byte r (least significant bit first), so the bitmap is a sum over the row and a thread
loads a row's 8 (or 16) contiguous bytes at once; no reshape of the words is needed but the one
that groups them into 32-bit words for the checksum's sums.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(pid, BLOCK: tl.constexpr):
    """(word offsets [BLOCK // 8, 8] of block `pid`, its bitmap byte offsets [BLOCK // 8], bit numbers [1, 8])."""
    rows = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    bit = tl.arange(0, 8)[None, :]
    return rows[:, None] * 8 + bit, rows, bit


@triton.jit
def _bits(bitmap_ptr, rows, bit, bitmap_bytes):
    """(the block's bitmap bytes, int32 0/1 per word [BLOCK // 8, 8], the exclusive prefix count of
    each word within the block: where its entry goes after the block's first)."""
    byts = tl.load(bitmap_ptr + rows, mask=rows < bitmap_bytes, other=0)
    bits = (byts.to(tl.int32)[:, None] >> bit) & 1
    per_row = tl.sum(bits, axis=1)
    before = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(bits, axis=1) - bits
    return byts, bits, before


@triton.jit
def _sums_change(a, b, rows, n_whole32, BLOCK: tl.constexpr, WORD: tl.constexpr):
    """[sum, sum of wrapped squares] (checksum.word_sums) of the tile's whole 32-bit words of `a`
    minus those of `b`."""
    PER: tl.constexpr = 4 // WORD  # words per 32-bit word
    sh = (tl.arange(0, PER) * (8 * WORD))[None, None, :]
    lane: tl.constexpr = (1 << (8 * WORD)) - 1
    # the lanes' bits are disjoint: their sum is the 32-bit word, with no carry
    a32 = tl.sum(tl.reshape(a.to(tl.int32) & lane, [BLOCK // 8, 8 // PER, PER]) << sh, axis=2)
    b32 = tl.sum(tl.reshape(b.to(tl.int32) & lane, [BLOCK // 8, 8 // PER, PER]) << sh, axis=2)
    w32 = rows[:, None] * (8 // PER) + tl.arange(0, 8 // PER)[None, :]
    keep = w32 < n_whole32  # the bucket's last bytes past its whole 32-bit words are not summed
    a32 = tl.where(keep, a32, 0)
    b32 = tl.where(keep, b32, 0)
    d1 = tl.sum(tl.sum(a32.to(tl.int64) - b32.to(tl.int64), axis=1), axis=0)
    d2 = tl.sum(tl.sum((a32 * a32).to(tl.int64) - (b32 * b32).to(tl.int64), axis=1), axis=0)  # squares wrap in int32
    return d1, d2


@triton.jit
def compare(
    new_ptr, base_ptr, bitmap_ptr, counts_ptr, sums_ptr, n_words, n_whole32, bitmap_bytes,
    BLOCK: tl.constexpr, WORD: tl.constexpr,
):  # fmt: skip
    """The bitmap of the words in which `new` and `base` differ, each block's count and sums change."""
    pid = tl.program_id(0).to(tl.int64)  # buckets may exceed 2**31 words
    offs, rows, bit = _tile(pid, BLOCK)
    m = offs < n_words
    a = tl.load(new_ptr + offs, mask=m, other=0)
    b = tl.load(base_ptr + offs, mask=m, other=0)
    bits = (a != b).to(tl.int32)
    tl.store(counts_ptr + pid, tl.sum(tl.sum(bits, axis=1), axis=0))
    tl.store(bitmap_ptr + rows, tl.sum(bits << bit, axis=1).to(tl.uint8), mask=rows < bitmap_bytes)
    d1, d2 = _sums_change(a, b, rows, n_whole32, BLOCK, WORD)
    tl.store(sums_ptr + pid * 2, d1)
    tl.store(sums_ptr + pid * 2 + 1, d2)


@triton.jit
def compact(
    new_ptr, bitmap_ptr, offsets_ptr, payload_ptr, bitmap_bytes, HDR: tl.constexpr,
    BLOCK: tl.constexpr, WORD: tl.constexpr,
):  # fmt: skip
    """The payload's bitmap (copied) and its new words (the changed ones, compacted) of one block."""
    pid = tl.program_id(0).to(tl.int64)
    offs, rows, bit = _tile(pid, BLOCK)
    byts, bits, before = _bits(bitmap_ptr, rows, bit, bitmap_bytes)
    tl.store(payload_ptr + HDR + rows, byts, mask=rows < bitmap_bytes)
    changed = bits != 0
    dst = tl.load(offsets_ptr + pid) + before.to(tl.int64)
    w = tl.load(new_ptr + offs, mask=changed, other=0)  # only the sectors that hold a changed word
    vals = payload_ptr + HDR + bitmap_bytes  # at any alignment: written byte by byte, little-endian
    if WORD == 2:
        tl.store(vals + 2 * dst, (w & 0xFF).to(tl.uint8), mask=changed)
        tl.store(vals + 2 * dst + 1, ((w >> 8) & 0xFF).to(tl.uint8), mask=changed)
    else:
        tl.store(vals + dst, w, mask=changed)


@triton.jit
def write_changed(new_ptr, bitmap_ptr, base_ptr, bitmap_bytes, BLOCK: tl.constexpr):
    """base = new where the bitmap says they differ."""
    pid = tl.program_id(0).to(tl.int64)
    offs, rows, bit = _tile(pid, BLOCK)
    _, bits, _ = _bits(bitmap_ptr, rows, bit, bitmap_bytes)
    changed = bits != 0
    tl.store(base_ptr + offs, tl.load(new_ptr + offs, mask=changed), mask=changed)


@triton.jit
def popcount(bitmap_ptr, counts_ptr, bitmap_bytes, BLOCK: tl.constexpr):
    """Each block's marked words."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    byts = tl.load(bitmap_ptr + rows, mask=rows < bitmap_bytes, other=0)
    bits = (byts.to(tl.int32)[:, None] >> tl.arange(0, 8)[None, :]) & 1
    tl.store(counts_ptr + pid, tl.sum(tl.sum(bits, axis=1), axis=0))


@triton.jit
def scatter(
    bitmap_ptr, offsets_ptr, base_ptr, pos_ptr, sums_ptr, bitmap_bytes, n_whole32,
    BLOCK: tl.constexpr, WORD: tl.constexpr, SUMS: tl.constexpr,
):  # fmt: skip
    """A bitmap payload's new words of one block into the base; their positions; the sums' change."""
    pid = tl.program_id(0).to(tl.int64)
    offs, rows, bit = _tile(pid, BLOCK)
    _, bits, before = _bits(bitmap_ptr, rows, bit, bitmap_bytes)
    changed = bits != 0
    src = tl.load(offsets_ptr + pid) + before.to(tl.int64)
    vals = bitmap_ptr + bitmap_bytes  # the payload's new words, at any alignment: read byte by byte
    if WORD == 2:
        lo = tl.load(vals + 2 * src, mask=changed, other=0).to(tl.int32)
        hi = tl.load(vals + 2 * src + 1, mask=changed, other=0).to(tl.int32)
        w = (lo | (hi << 8)).to(tl.int16)
    else:
        w = tl.load(vals + src, mask=changed, other=0)
    if SUMS:
        # the old words of each 32-bit word that holds a written word (its unchanged lanes too)
        PER: tl.constexpr = 4 // WORD
        group = tl.max(tl.reshape(bits, [BLOCK // 8, 8 // PER, PER]), axis=2)
        near = tl.reshape(tl.broadcast_to(group[:, :, None], [BLOCK // 8, 8 // PER, PER]), [BLOCK // 8, 8]) != 0
        old = tl.load(base_ptr + offs, mask=near, other=0)
        w = tl.where(changed, w, old)  # the store below depends on the load: it cannot go first
        d1, d2 = _sums_change(w, old, rows, n_whole32, BLOCK, WORD)
        tl.store(sums_ptr + pid * 2, d1)
        tl.store(sums_ptr + pid * 2 + 1, d2)
    tl.store(base_ptr + offs, w, mask=changed)
    tl.store(pos_ptr + src, offs, mask=changed)
