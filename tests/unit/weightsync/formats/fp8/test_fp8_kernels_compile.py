"""The FP8 kernels (fp8/quantize_triton.py, fp8/dequantize_triton.py: the per-tensor ones and the fused
slot ones, which share their block arithmetic as jitted helpers; fp8/write_slots_triton.py, which calls
both's) compile for an H100 (sm_90), the slot and fused-write kernels with the GPU's conversions
(PTX) and with the bit arithmetic,
down to a cubin, on a machine without a GPU: Triton's interpreter, which the byte-for-byte tests use,
accepts code the compiler refuses (a variable typed differently in two branches, a scalar mask).
Skipped where triton is not installed (CI); run in a subprocess with a fresh cache, so it compiles."""

from __future__ import annotations

from tests.support.triton_cpu import compile_for_sm90

SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weightsync.formats.fp8 import dequantize_slots_triton, quantize_slots_triton, blocks_triton, write_slots
from weightsync.formats.fp8.write_slots_triton import write_slots as write_slots_kernel

target = GPUTarget("cuda", 90, 32)


def build(fn, signature, constexprs):
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                            options={"num_warps": 8})
    assert "cubin" in kernel.asm, sorted(kernel.asm)


for src, cvt in (("*bf16", True), ("*bf16", False), ("*fp16", True), ("*fp32", True)):
    build(
        quantize_slots_triton._kernel(),
        {"src_base": src, "row_ptr": "*i64", "tensor_ptr": "*i64", "owner_ptr": "*i32", "q_base": "*u8",
         "s_base": "*fp32", "flag_ptr": "*i32", "sums_ptr": "*i64", "BR": "constexpr", "BC": "constexpr",
         "RB": "constexpr", "FMAX": "constexpr", "SMIN": "constexpr", "VEC": "constexpr", "SUMS": "constexpr",
         "CVT": "constexpr"},
        {"BR": 128, "BC": 128, "RB": quantize_slots_triton.TILE_ROWS, "FMAX": 448.0, "SMIN": 2.0**-126,
         "VEC": quantize_slots_triton.MAX_VEC, "SUMS": True, "CVT": cvt},
    )
build(
    dequantize_slots_triton._kernel(),
    {"buf_bytes": "*u8", "buf_words": "*i32", "buf_f32": "*fp32", "word_base": "*i32", "bf16_base": "*i16",
     "f32_base": "*fp32", "word_ptr": "*i64", "n_word": "i32", "tensor_ptr": "*i64", "owner_ptr": "*i32",
     "out_ptr": "*i64", "WB": "constexpr", "WS": "constexpr", "BR": "constexpr", "BC": "constexpr",
     "RB": "constexpr", "VEC": "constexpr", "WV": "constexpr"},
    {"WB": dequantize_slots_triton.WORD_BLOCK, "WS": dequantize_slots_triton.WORD_STEPS, "BR": 128, "BC": 128,
     "RB": dequantize_slots_triton.TILE_ROWS, "VEC": dequantize_slots_triton.MAX_VEC,
     "WV": dequantize_slots_triton.MAX_WV},
)
for x in ("*bf16", "*fp32"):
    build(
        blocks_triton._kernel(),
        {"x_ptr": x, "q_ptr": "*u8", "s_ptr": "*fp32", "rows": "i64", "cols": "i64", "n_rb": "i64", "n_cb": "i64",
         "BR": "constexpr", "BC": "constexpr", "FMAX": "constexpr", "SMIN": "constexpr"},
        {"BR": 128, "BC": 128, "FMAX": 448.0, "SMIN": 2.0**-126},
    )
for out, bf16 in (("*i16", True), ("*fp32", False)):
    build(
        blocks_triton._dequant_kernel(),
        {"q_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": out, "rows": "i64", "cols": "i64", "n_rb": "i64",
         "n_cb": "i64", "BR": "constexpr", "BC": "constexpr", "OUT_BF16": "constexpr"},
        {"BR": 128, "BC": 128, "OUT_BF16": bf16},
    )
for src in ("*bf16", "*fp32"):
    for vec, cvt in ((quantize_slots_triton.MAX_VEC, True), (quantize_slots_triton.MAX_VEC, False), (4, True)):
        build(
            write_slots_kernel,
            {"src_base": src, "row_ptr": "*i64", "tensor_ptr": "*i64", "owner_ptr": "*i32", "bf16_base": "*i16",
             "f32_base": "*fp32", "flag_ptr": "*i32", "sums_ptr": "*i64", "BR": "constexpr", "BC": "constexpr",
             "RB": "constexpr", "FMAX": "constexpr", "SMIN": "constexpr", "VEC": "constexpr", "CVT": "constexpr"},
            {"BR": 128, "BC": 128, "RB": write_slots.TILE_ROWS, "FMAX": 448.0, "SMIN": 2.0**-126, "VEC": vec,
             "CVT": cvt},
        )
print("compiled")
"""


def test_the_fp8_kernels_compile_for_sm90(tmp_path):
    compile_for_sm90(SCRIPT, tmp_path / "cache")
