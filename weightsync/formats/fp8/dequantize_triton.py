"""The Triton kernels that dequantize block FP8: a tensor's blocks (`dequant_block`, blocks_triton.py)
and a received bucket into the engine's parameters, checksummed as it goes (`dequant_bucket`,
dequantize_slots_triton.py says what its two kinds of programs do). Both decode and round with
the same helpers (`from_e4m3`, `to_bf16_bits`), bit for bit the torch path's.

Imported only by those modules, lazily: triton comes with CUDA builds of torch, not the CPU build.
The helpers are module globals because a `@triton.jit` function resolves the functions it calls
among its module's globals (compiled, and under the CPU interpreter alike).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def from_e4m3(code):
    """float32 of e4m3fn codes (uint8), exact: every e4m3 value is a float16 and a float32, so the
    GPU's conversion (two codes per instruction to float16, then float32) has nothing to round;
    NaN for e4m3fn's two NaN codes (which the quantizer never writes: it clamps to +-448). Decoding
    on the bits took ten integer operations per element, a third of the kernel's instructions."""
    v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def to_bf16_bits(x):
    """The bfloat16 bits (int16) of float32 `x`, rounded to nearest even on the bits as torch's
    float -> bfloat16 conversion does."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def to_bf16_cvt(x):
    """`to_bf16_bits` by the GPU's own conversion (sm_80 and later; round to nearest even, one
    instruction where the bits take four), written as PTX as quantize_triton.to_e4m3_cvt is."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.u32.u16 $0, h; }",
        "=r,f",
        [x],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    ).to(tl.int16)


@triton.jit
def bf16_bits(x, CVT: tl.constexpr):
    """The bfloat16 bits (int16) of float32 `x`: by the GPU's conversion (CVT) or on the bits."""
    if CVT:
        return to_bf16_cvt(x)
    else:
        return to_bf16_bits(x)


@triton.jit
def dequant_block(
    q_ptr, s_ptr, out_ptr, rows, cols, n_rb, n_cb, BR: tl.constexpr, BC: tl.constexpr, OUT_BF16: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    per_matrix = n_rb * n_cb
    b = pid // per_matrix
    r = (pid % per_matrix) // n_cb * BR + tl.arange(0, BR).to(tl.int64)
    c = pid % n_cb * BC + tl.arange(0, BC).to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    offs = b * rows * cols + r[:, None] * cols + c[None, :]
    code = tl.load(q_ptr + offs, mask=mask, other=0)
    s = tl.load(s_ptr + pid)
    # one float32 product, one rounding to the output dtype (as float32(q) * s then .to(dtype))
    prod = from_e4m3(code) * s
    if OUT_BF16:
        tl.store(out_ptr + offs, to_bf16_bits(prod), mask=mask)
    else:
        tl.store(out_ptr + offs, prod.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def word_run(
    buf_words, word_base, out_ptr, pid, src, n, dst, has_dst, WB: tl.constexpr, WS: tl.constexpr, WV: tl.constexpr
):
    """A word program of dequant_bucket: `n` words from word `src` summed (and copied to word `dst`).
    WV (constexpr): what src, n and dst are multiples of; multiplying the quotients back by it tells
    the compiler so (offsets read from a table have no known alignment: one word per access)."""
    src = (src // WV) * WV
    n = (n // WV) * WV
    dst = (dst // WV) * WV
    acc1 = tl.zeros([WB], dtype=tl.int64)
    acc2 = tl.zeros([WB], dtype=tl.int64)
    for i in range(WS):
        offs = i * WB + tl.arange(0, WB)
        mask = offs < n
        w = tl.load(buf_words + src + offs, mask=mask, other=0)
        tl.store(word_base + dst + offs, w, mask=mask & (has_dst != 0))
        acc1 += w.to(tl.int64)
        acc2 += (w * w).to(tl.int64)  # the square wraps in int32, as copy/checksum.py's
    tl.store(out_ptr + pid * 2, tl.sum(acc1, axis=0))
    tl.store(out_ptr + pid * 2 + 1, tl.sum(acc2, axis=0))


@triton.jit
def dequant_tile(
    buf_bytes,
    buf_words,
    buf_f32,
    bf16_base,
    f32_base,
    out_ptr,
    pid,
    entry,
    tile_pid,
    BR: tl.constexpr,
    BC: tl.constexpr,
    RB: tl.constexpr,
    VEC: tl.constexpr,
):
    """Tile k (row-major) of RB rows x BC columns of one FP8 weight of dequant_bucket, inside one
    BR x BC block (its scale's). VEC (constexpr): what cols, the e4m3 offset and the destination
    offset of every weight of the launch are multiples of (as word_run's WV). A tile of a quarter
    block: the whole 128 x 128 block in registers held an SM to two programs at a time, each
    loading, computing and storing in turn (~40% of the copy bandwidth); small tiles let many
    programs per SM overlap their loads with the others' work. `entry`: the weight's row of the tensor
    table (rows, cols, e4m3 offset, scale here?, scale offset, destination offset, its first tile
    program, float32 out?, summed?); `tile_pid`: this program's index among the tile programs."""
    rows = tl.load(entry)
    cols = tl.load(entry + 1)
    q_off = tl.load(entry + 2)
    s_here = tl.load(entry + 3)
    s_off = tl.load(entry + 4)
    d_off = tl.load(entry + 5)
    k = tile_pid - tl.load(entry + 6)  # this tile's index in its weight (row-major)
    out_f32 = tl.load(entry + 7)
    sums = tl.load(entry + 8)
    cols = (cols // VEC) * VEC
    q_off = (q_off // VEC) * VEC
    d_off = (d_off // VEC) * VEC
    n_cb = (cols + BC - 1) // BC
    cb = k % n_cb
    c0 = cb * BC
    r0 = (k // n_cb) * RB
    r = r0 + tl.arange(0, RB).to(tl.int64)
    c = c0 + tl.arange(0, BC)
    rmask = r < rows
    mask = rmask[:, None] & (c[None, :] < cols)
    offs = r[:, None] * cols + c[None, :]
    code = tl.load(buf_bytes + q_off + offs, mask=mask, other=0)
    blk = (r0 // BR) * n_cb + cb  # the scale's block
    if s_here != 0:
        s = tl.load(buf_f32 + s_off + blk)
    else:
        s = tl.load(f32_base + s_off + blk)
    prod = from_e4m3(code) * s  # dequant_block's product and rounding
    if out_f32 != 0:
        tl.store(f32_base + d_off + offs, prod, mask=mask)
    else:
        tl.store(bf16_base + d_off + offs, to_bf16_bits(prod), mask=mask)
    # the block's own words (rows of whole words: cols and q_off multiples of 4)
    if VEC % 4 == 0:  # in words, as multiples of VEC // 4 the compiler can see: 16-byte loads
        cw = cb * (BC // 4) + tl.arange(0, BC // 4)
        wcols = (cols // VEC) * (VEC // 4)
        wmask = rmask[:, None] & (cw[None, :] < wcols) & (sums != 0)
        widx = (q_off // VEC) * (VEC // 4) + r[:, None] * wcols + cw[None, :]
    else:
        j = tl.arange(0, BC // 4)
        wmask = rmask[:, None] & (c0 + 4 * j[None, :] < cols) & (sums != 0)
        widx = (q_off + r[:, None] * cols + c0) // 4 + j[None, :]
    w = tl.load(buf_words + widx, mask=wmask, other=0)
    tl.store(out_ptr + pid * 2, tl.sum(tl.sum(w.to(tl.int64), axis=1), axis=0))
    tl.store(out_ptr + pid * 2 + 1, tl.sum(tl.sum((w * w).to(tl.int64), axis=1), axis=0))


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
    RB: tl.constexpr,
    VEC: tl.constexpr,
    WV: tl.constexpr,
):
    # VEC: what every column count and element offset of the launch's tensor table is a multiple of;
    # a word run whose table row says so takes the WV-word variant (a uniform branch: a run of an
    # odd length, such as a 1x1 scale, leaves the others wide); dequantize_slots_triton.py says why
    pid = tl.program_id(0).to(tl.int64)
    if pid < n_word:
        row = word_ptr + pid * 5
        src = tl.load(row)
        n = tl.load(row + 1)
        dst = tl.load(row + 2)
        has_dst = tl.load(row + 3)
        if tl.load(row + 4) != 0:
            word_run(buf_words, word_base, out_ptr, pid, src, n, dst, has_dst, WB, WS, WV)
        else:
            word_run(buf_words, word_base, out_ptr, pid, src, n, dst, has_dst, WB, WS, 1)
    else:
        t = tl.load(owner_ptr + (pid - n_word)).to(tl.int64) * 9
        dequant_tile(
            buf_bytes,
            buf_words,
            buf_f32,
            bf16_base,
            f32_base,
            out_ptr,
            pid,
            tensor_ptr + t,
            pid - n_word,
            BR,
            BC,
            RB,
            VEC,
        )
