"""The Triton kernels of the fused delta codec (codec_triton.py says what each does and why).

Imported only by codec_triton, lazily: triton comes with CUDA builds of torch, not the CPU build.
Each program takes a block of BLOCK words as a [BLOCK // 8, 8] tile: row r holds the 8 words of
bitmap byte r (least significant bit first), so the bitmap is a sum over the row and a thread
loads a row's 8 (or 16) contiguous bytes at once; no reshape of the words is needed but the one
that groups them into 32-bit words for the checksum's sums. Offsets within a block are int32 from
the block's pointers (int64 scalars): int64 per word would double the registers of the scatters.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(pid, n, per_block, BLOCK: tl.constexpr):
    """(int32 offsets [BLOCK // 8, 8] within block `pid` of its words, by row; the rows [BLOCK // 8];
    the bit numbers [1, 8]; how many of `n` things of `per_block` a block fall in this one, int32)."""
    rows = tl.arange(0, BLOCK // 8)
    bit = tl.arange(0, 8)[None, :]
    left = tl.maximum(tl.minimum(n - pid * per_block, per_block), 0).to(tl.int32)
    return rows[:, None] * 8 + bit, rows, bit, left


@triton.jit
def _bits(bitmap_ptr, rows, bit, left_bytes):
    """(the block's bitmap bytes, int32 0/1 per word [BLOCK // 8, 8], the exclusive prefix count of
    each word within the block: where its entry goes after the block's first)."""
    byts = tl.load(bitmap_ptr + rows, mask=rows < left_bytes, other=0)
    bits = (byts.to(tl.int32)[:, None] >> bit) & 1
    per_row = tl.sum(bits, axis=1)
    before = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(bits, axis=1) - bits
    return byts, bits, before


@triton.jit
def _sums_change(a, b, pid, rows, n_whole32, BLOCK: tl.constexpr, WORD: tl.constexpr):
    """[sum, sum of wrapped squares] (checksum.word_sums) of the tile's whole 32-bit words of `a`
    minus those of `b`."""
    # 4 // WORD words per 32-bit word, each in its lane of 8 * WORD bits (inline: constexpr arithmetic);
    # the lanes' bits are disjoint, so their sum is the 32-bit word, with no carry
    sh = (tl.arange(0, 4 // WORD) * (8 * WORD))[None, None, :]
    a32 = tl.sum(tl.reshape(a.to(tl.int32) & ((1 << (8 * WORD)) - 1), [BLOCK // 8, 2 * WORD, 4 // WORD]) << sh, axis=2)
    b32 = tl.sum(tl.reshape(b.to(tl.int32) & ((1 << (8 * WORD)) - 1), [BLOCK // 8, 2 * WORD, 4 // WORD]) << sh, axis=2)
    left = tl.maximum(tl.minimum(n_whole32 - pid * (BLOCK * WORD // 4), BLOCK * WORD // 4), 0).to(tl.int32)
    # the bucket's last bytes past its whole 32-bit words are not summed
    keep = rows[:, None] * (2 * WORD) + tl.arange(0, 2 * WORD)[None, :] < left
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
    offs, rows, bit, left = _tile(pid, n_words, BLOCK, BLOCK)
    m = offs < left
    a = tl.load(new_ptr + pid * BLOCK + offs, mask=m, other=0)
    b = tl.load(base_ptr + pid * BLOCK + offs, mask=m, other=0)
    bits = (a != b).to(tl.int32)
    tl.store(counts_ptr + pid, tl.sum(tl.sum(bits, axis=1), axis=0))
    left_bytes = tl.minimum(bitmap_bytes - pid * (BLOCK // 8), BLOCK // 8).to(tl.int32)
    tl.store(bitmap_ptr + pid * (BLOCK // 8) + rows, tl.sum(bits << bit, axis=1).to(tl.uint8), mask=rows < left_bytes)
    d1, d2 = _sums_change(a, b, pid, rows, n_whole32, BLOCK, WORD)
    tl.store(sums_ptr + pid * 2, d1)
    tl.store(sums_ptr + pid * 2 + 1, d2)


@triton.jit
def compact(
    new_ptr, bitmap_ptr, offsets_ptr, payload_ptr, bitmap_bytes, HDR: tl.constexpr,
    BLOCK: tl.constexpr, WORD: tl.constexpr,
):  # fmt: skip
    """The payload's bitmap (copied) and its new words (the changed ones, compacted) of one block."""
    pid = tl.program_id(0).to(tl.int64)
    offs, rows, bit, left_bytes = _tile(pid, bitmap_bytes, BLOCK // 8, BLOCK)
    byts, bits, before = _bits(bitmap_ptr + pid * (BLOCK // 8), rows, bit, left_bytes)
    tl.store(payload_ptr + HDR + pid * (BLOCK // 8) + rows, byts, mask=rows < left_bytes)
    changed = bits != 0
    w = tl.load(new_ptr + pid * BLOCK + offs, mask=changed, other=0)  # only the sectors that hold a changed word
    # at any alignment: written byte by byte, little-endian, from the block's first entry on
    vals = payload_ptr + HDR + bitmap_bytes + WORD * tl.load(offsets_ptr + pid)
    if WORD == 2:
        tl.store(vals + 2 * before, (w & 0xFF).to(tl.uint8), mask=changed)
        tl.store(vals + 2 * before + 1, ((w >> 8) & 0xFF).to(tl.uint8), mask=changed)
    else:
        tl.store(vals + before, w, mask=changed)


@triton.jit
def write_changed(new_ptr, bitmap_ptr, base_ptr, bitmap_bytes, BLOCK: tl.constexpr):
    """base = new where the bitmap says they differ."""
    pid = tl.program_id(0).to(tl.int64)
    offs, rows, bit, left_bytes = _tile(pid, bitmap_bytes, BLOCK // 8, BLOCK)
    _, bits, _ = _bits(bitmap_ptr + pid * (BLOCK // 8), rows, bit, left_bytes)
    changed = bits != 0
    w = tl.load(new_ptr + pid * BLOCK + offs, mask=changed)
    tl.store(base_ptr + pid * BLOCK + offs, w, mask=changed)


@triton.jit
def popcount(bitmap_ptr, counts_ptr, bitmap_bytes, BLOCK: tl.constexpr):
    """Each block's marked words."""
    pid = tl.program_id(0).to(tl.int64)
    _, rows, bit, left_bytes = _tile(pid, bitmap_bytes, BLOCK // 8, BLOCK)
    _, bits, _ = _bits(bitmap_ptr + pid * (BLOCK // 8), rows, bit, left_bytes)
    tl.store(counts_ptr + pid, tl.sum(tl.sum(bits, axis=1), axis=0))


@triton.jit
def scatter(
    bitmap_ptr, offsets_ptr, base_ptr, pos_ptr, sums_ptr, bitmap_bytes, n_whole32,
    BLOCK: tl.constexpr, WORD: tl.constexpr, SUMS: tl.constexpr,
):  # fmt: skip
    """A bitmap payload's new words of one block into the base; their positions; the sums' change."""
    pid = tl.program_id(0).to(tl.int64)
    offs, rows, bit, left_bytes = _tile(pid, bitmap_bytes, BLOCK // 8, BLOCK)
    _, bits, before = _bits(bitmap_ptr + pid * (BLOCK // 8), rows, bit, left_bytes)
    changed = bits != 0
    first = tl.load(offsets_ptr + pid)
    vals = bitmap_ptr + bitmap_bytes + WORD * first  # the block's new words, at any alignment: byte by byte
    if WORD == 2:
        lo = tl.load(vals + 2 * before, mask=changed, other=0).to(tl.int32)
        hi = tl.load(vals + 2 * before + 1, mask=changed, other=0).to(tl.int32)
        w = (lo | (hi << 8)).to(tl.int16)
    else:
        w = tl.load(vals + before, mask=changed, other=0)
    words = base_ptr + pid * BLOCK
    if SUMS:
        # the old words of each 32-bit word that holds a written word (its unchanged lanes too)
        group = tl.max(tl.reshape(bits, [BLOCK // 8, 2 * WORD, 4 // WORD]), axis=2)
        near = tl.reshape(tl.broadcast_to(group[:, :, None], [BLOCK // 8, 2 * WORD, 4 // WORD]), [BLOCK // 8, 8]) != 0
        old = tl.load(words + offs, mask=near, other=0)
        w = tl.where(changed, w, old)  # the store below depends on the load: it cannot go first
        d1, d2 = _sums_change(w, old, pid, rows, n_whole32, BLOCK, WORD)
        tl.store(sums_ptr + pid * 2, d1)
        tl.store(sums_ptr + pid * 2 + 1, d2)
    tl.store(words + offs, w, mask=changed)
    tl.store(pos_ptr + first + before, pid * BLOCK + offs, mask=changed)
