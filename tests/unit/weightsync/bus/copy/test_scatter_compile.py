"""The copy-and-checksum kernels of every scatter_triton config compile for an H100 (sm_90) down to a cubin,
on a machine without a GPU (Triton's interpreter, which test_scatter_rows.py runs them through, accepts
code the compiler refuses), and the aligned-row kernel's rows really move 16 bytes per access (the point
of copy/scatter_rows.py: a kernel whose addresses are read from its table moves 4). Skipped where triton is not
installed (CI); run in a subprocess with a fresh cache, so it compiles."""

from __future__ import annotations

from tests.support.triton_cpu import compile_for_sm90

SCRIPT = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weightsync.bus.copy import scatter_triton

target = GPUTarget("cuda", 90, 32)
aligned = {0: [["tt.divisibility", 16]], 1: [["tt.divisibility", 16]]}  # the bases: the anchor tensor
done = {}
for c in scatter_triton.CONFIGS.values():
    key = (c.block, c.steps, c.warps, c.fold)
    if key in done:
        continue
    consts = {"BLOCK": c.block, "STEPS": c.steps, "VEC": 4, "FOLD": c.fold}
    sig = {"src_base": "*i32", "dst_base": "*i32", "table_ptr": "*i64", "out_ptr": "*i64", "n_rows": "i32",
           **{k: "constexpr" for k in consts}}
    for name, fn in (("vec", scatter_triton._kernel()), ("short", scatter_triton._short_kernel())):  # short: TP shards
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={(k,): v for k, v in aligned.items()})
        kernel = triton.compile(src, target=target, options={"num_warps": c.warps})
        assert "cubin" in kernel.asm, sorted(kernel.asm)
        wide = len(re.findall(r"ld\\.global[^\\n]*\\.v4", kernel.asm["ptx"]))
        done[(name, *key)] = wide
        assert wide > 0, (c.name, name, wide)
print("compiled", done)
"""


def test_every_config_compiles_for_sm90_with_16_byte_accesses_where_aligned(tmp_path):
    compile_for_sm90(SCRIPT, tmp_path / "cache")
