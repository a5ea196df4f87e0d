"""The fused delta kernels (delta/kernels_triton.py) compile for an H100 (sm_90) down to a cubin, at codec_triton's
block size and warps, on a machine without a GPU: Triton's interpreter, which test_delta_codec_triton.py runs them
through, accepts code the compiler refuses. Skipped where triton is not installed (CI); run in a subprocess
with a fresh cache, so it compiles."""

from __future__ import annotations

from tests.support.triton_cpu import compile_for_sm90

SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weightsync.bus.delta import codec_triton, kernels_triton as k

target = GPUTarget("cuda", 90, 32)


def build(fn, signature, constexprs):
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    constexprs = {**constexprs, "BLOCK": codec_triton.BLOCK}
    signature["BLOCK"] = "constexpr"
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                            options={"num_warps": codec_triton.WARPS})
    assert "cubin" in kernel.asm, sorted(kernel.asm)


for word, w in ((1, "*u8"), (2, "*i16")):
    build(k.compare, {"new_ptr": w, "base_ptr": w, "bitmap_ptr": "*u8", "counts_ptr": "*i64", "sums_ptr": "*i64",
                      "n_words": "i64", "n_whole32": "i64", "bitmap_bytes": "i64"}, {"WORD": word})
    build(k.compact, {"new_ptr": w, "bitmap_ptr": "*u8", "offsets_ptr": "*i64", "payload_ptr": "*u8",
                      "bitmap_bytes": "i64"}, {"HDR": 16, "WORD": word})
    build(k.write_changed, {"new_ptr": w, "bitmap_ptr": "*u8", "base_ptr": w, "bitmap_bytes": "i64"}, {})
    for sums in (True, False):
        build(k.scatter, {"bitmap_ptr": "*u8", "offsets_ptr": "*i64", "base_ptr": w, "pos_ptr": "*i64",
                          "sums_ptr": "*i64", "bitmap_bytes": "i64", "n_whole32": "i64"}, {"WORD": word, "SUMS": sums})
build(k.popcount, {"bitmap_ptr": "*u8", "counts_ptr": "*i64", "bitmap_bytes": "i64"}, {})
print("compiled")
"""


def test_the_fused_delta_kernels_compile_for_sm90(tmp_path):
    compile_for_sm90(SCRIPT, tmp_path / "cache")
