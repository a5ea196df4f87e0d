"""The Triton kernels that quantize to block FP8: a tensor's blocks (`quant_block`, blocks_triton.py
says why its bytes equal torch's) and weights written into bucket slots (`quant_slots`,
quantize_slots_triton.py). Both call one definition of a block's scale and of the float32 -> e4m3fn
rounding (`block_scale`, `to_e4m3`), so the two cannot drift apart.

Imported only by those modules, lazily: triton comes with CUDA builds of torch, not the CPU build.
The helpers are module globals because a `@triton.jit` function resolves the functions it calls
among its module's globals (compiled, and under the CPU interpreter alike).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def magnitudes(x):
    """|x| of a float32 tile, inf where a value is NaN: what a block's amax is the maximum of."""
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def abs_max(x):
    """max |x| of a float32 tile, inf when any value is NaN (or infinite)."""
    return tl.max(tl.max(magnitudes(x), axis=1), axis=0)


@triton.jit
def scale_of(amax, FMAX: tl.constexpr, SMIN: tl.constexpr):
    """amax / FMAX (IEEE division, as torch's), 1.0 for an all-tiny block, inf for a block holding
    a NaN or infinite value (it is then refused)."""
    s = tl.div_rn(amax, FMAX)
    return tl.where(s < SMIN, 1.0, s)


@triton.jit
def block_scale(x, FMAX: tl.constexpr, SMIN: tl.constexpr):
    """The scale of a float32 block held whole."""
    return scale_of(abs_max(x), FMAX, SMIN)


@triton.jit
def to_e4m3(x, s, FMAX: tl.constexpr):
    """The e4m3fn codes (int32, 0..255) of x / s, clamped to +-FMAX, rounded to nearest even on
    the bits (|y| <= 448: no overflow case left)."""
    y = tl.div_rn(x, s)
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|y| >= 2**-6): drop 20 mantissa bits with RNE, then rebias 127 -> 7
    odd = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + odd) >> 20) - ((127 - 7) << 3)
    # subnormal e4m3 (|y| < 2**-6, steps of 2**-9): |y| * 512 rounded to an integer in 0..8 by
    # adding 2**23 (a float32 add rounds to nearest even); 8 is the smallest normal code
    t = tl.abs(y) * 512.0 + 8388608.0
    sub = t.to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(mag < (121 << 23), sub, normal) | sign


@triton.jit
def to_e4m3_cvt(x, s):
    """`to_e4m3` by the GPU's own conversion (sm_89 and later: round to nearest even, saturating to
    +-448 as the clamp does): two instructions where the bits take about fifteen. Written as PTX,
    one value per instruction with a zero partner, so no compiler's packing of value pairs is
    trusted: Triton's own float8 downcast gave wrong codes for 16-wide tiles on an H200. A block
    holding a NaN or infinite value has an infinite scale and is refused whatever its codes. The
    CPU interpreter has no PTX and takes `to_e4m3`; GPU tests hold the two equal.

    The division stays IEEE (`div_rn`): dividing by the block's reciprocal with one FMA correction
    (the same codes for every bfloat16 and random float32 value over scales 2^-126 .. 2^127, checked
    on the CPU) measured no faster for a 7B model's fused write on GPU (in a run that also changed the
    block's reductions)."""
    y = tl.div_rn(x, s)
    return tl.inline_asm_elementwise(
        "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, $1; cvt.u32.u16 $0, h; }",
        "=r,f",
        [y],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def e4m3_codes(x, s, FMAX: tl.constexpr, CVT: tl.constexpr):
    """The e4m3fn codes (int32, 0..255) of x / s: by the GPU's conversion (CVT) or on the bits."""
    if CVT:
        return to_e4m3_cvt(x, s)
    else:
        return to_e4m3(x, s, FMAX)


@triton.jit
def block_columns(cols, k, BR: tl.constexpr, BC: tl.constexpr, VEC: tl.constexpr):
    """Block k (row-major) of a weight of `cols` columns: its columns as the compiler sees them (a multiple
    of VEC: quant_slots says why), its first row, its column indices and their mask."""
    cols = (cols // VEC) * VEC
    n_cb = (cols + BC - 1) // BC
    c = (k % n_cb) * BC + tl.arange(0, BC)
    return cols, (k // n_cb) * BR, c, c < cols


@triton.jit
def source_tile(src_base, row_ptr, row0, r0, i, rows, c, cmask, RB: tl.constexpr, VEC: tl.constexpr):
    """Tile i (RB rows from row r0) of a block read through the row table (`row_ptr[row0 + r]`: each
    row's first element in `src_base`, a multiple of VEC): its rows, its mask and its float32 values
    (0 where masked off)."""
    r = r0 + i * RB + tl.arange(0, RB).to(tl.int64)
    rmask = r < rows
    mask = rmask[:, None] & cmask[None, :]
    src = tl.load(row_ptr + row0 + r, mask=rmask, other=0)
    src = (src // VEC) * VEC
    x = tl.load(src_base + src[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
    return r, mask, x


@triton.jit
def block_amax(src_base, row_ptr, row0, r0, c, cmask, rows, BR: tl.constexpr, RB: tl.constexpr, VEC: tl.constexpr):
    """The amax of a block (`source_tile`'s), read RB rows at a time (quant_slots says why): each thread
    keeps the maxima of its own elements across the tiles, reduced across the block once (a
    cross-warp reduction per tile cost a round trip through shared memory and a barrier each)."""
    a = tl.zeros([RB, c.shape[0]], dtype=tl.float32)
    for i in range(BR // RB):
        _, _, x = source_tile(src_base, row_ptr, row0, r0, i, rows, c, cmask, RB, VEC)
        a = tl.maximum(a, magnitudes(x))
    return tl.max(tl.max(a, axis=1), axis=0)


@triton.jit
def code_word_sums(code, RB: tl.constexpr, BC: tl.constexpr):
    """The ws-sum64 word sums (sum, sum of squares; int64) of each row of an RB x BC tile of e4m3
    codes stored as bytes, rows of whole 32-bit words: bytes into little-endian words have disjoint
    bits, so the int32 sum is their OR (wrapping to the signed word, as a view of the bytes reads
    it); masked-off codes are 0 and add nothing. Per row: the caller adds the tiles' rows and sums
    them across the block once, not once per tile."""
    words = tl.sum(tl.reshape(code, (RB, BC // 4, 4)) << (tl.arange(0, 4) * 8)[None, None, :], axis=2)
    s1 = tl.sum(words.to(tl.int64), axis=1)
    s2 = tl.sum((words * words).to(tl.int64), axis=1)
    return s1, s2


@triton.jit
def quant_block(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    n_rb,
    n_cb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    FMAX: tl.constexpr,
    SMIN: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    per_matrix = n_rb * n_cb
    b = pid // per_matrix
    rb = (pid % per_matrix) // n_cb
    cb = pid % n_cb
    r = rb * BR + tl.arange(0, BR).to(tl.int64)
    c = cb * BC + tl.arange(0, BC).to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    offs = b * rows * cols + r[:, None] * cols + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = block_scale(x, FMAX, SMIN)
    code = to_e4m3(x, s, FMAX)
    tl.store(q_ptr + offs, code.to(tl.uint8), mask=mask)
    tl.store(s_ptr + pid, s)


@triton.jit
def quant_slots(
    src_base,
    row_ptr,
    tensor_ptr,
    owner_ptr,
    q_base,
    s_base,
    flag_ptr,
    sums_ptr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    RB: tl.constexpr,
    FMAX: tl.constexpr,
    SMIN: tl.constexpr,
    VEC: tl.constexpr,
    SUMS: tl.constexpr,
    CVT: tl.constexpr,
):
    """One program per block: block k (row-major) of the tensor that owns it, RB rows at a time, in
    two passes: the block's amax, then its codes (the second read of its rows comes from the cache).
    The whole 128 x 128 block in float32 registers held an SM to two programs at a time, each loading,
    reducing and storing in turn (~40% of the copy bandwidth); RB-row tiles let many programs per
    SM overlap their loads with the others' work.

    VEC (constexpr): what every tensor's columns, e4m3 offset and source row offsets in the launch
    are multiples of; multiplying the quotients back by it tells the compiler so, which lets it
    read and write VEC elements per instruction (offsets read from tables prove no alignment at
    all: one element, one byte, per access)."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(owner_ptr + pid).to(tl.int64) * 6
    rows = tl.load(tensor_ptr + t)
    cols = tl.load(tensor_ptr + t + 1)
    q_off = (tl.load(tensor_ptr + t + 2) // VEC) * VEC
    s_off = tl.load(tensor_ptr + t + 3)
    row0 = tl.load(tensor_ptr + t + 4)
    k = pid - tl.load(tensor_ptr + t + 5)  # this block's index in its tensor (row-major)
    cols, r0, c, cmask = block_columns(cols, k, BR, BC, VEC)
    s = scale_of(block_amax(src_base, row_ptr, row0, r0, c, cmask, rows, BR, RB, VEC), FMAX, SMIN)
    s1 = tl.zeros([RB], dtype=tl.int64)
    s2 = tl.zeros([RB], dtype=tl.int64)
    for i in range(BR // RB):
        r, mask, x = source_tile(src_base, row_ptr, row0, r0, i, rows, c, cmask, RB, VEC)
        code = e4m3_codes(x, s, FMAX, CVT)
        tl.store(q_base + q_off + r[:, None] * cols + c[None, :], code.to(tl.uint8), mask=mask)
        if SUMS:
            # the word sums of what this block wrote (its rows are whole 32-bit words: cols and the
            # offset are multiples of 4), so the bucket's checksum need not read them again
            t1, t2 = code_word_sums(code, RB, BC)
            s1 += t1
            s2 += t2
    tl.store(s_base + s_off + k, s)
    tl.atomic_max(flag_ptr, 1, mask=s == float("inf"))  # only a diverged block touches the flag
    if SUMS:
        tl.store(sums_ptr + pid * 4, tl.sum(s1, axis=0))
        tl.store(sums_ptr + pid * 4 + 1, tl.sum(s2, axis=0))
        sw = s.to(tl.int32, bitcast=True)  # the scale's own word, in whichever bucket holds it
        tl.store(sums_ptr + pid * 4 + 2, sw.to(tl.int64))
        tl.store(sums_ptr + pid * 4 + 3, (sw * sw).to(tl.int64))
