"""Block FP8 quantization straight into bucket slots: one Triton launch per bucket (quantize_slots.py).

The per-tensor quantizer (blocks_triton.py) takes a contiguous tensor and returns new ones, which the
pipeline then copies into a bucket: one launch per weight plus a pack copy. Here one program still
owns one 128x128 block, but its rows are read through a per-row table of source offsets (so a
weight may be any set of contiguous rows of a parameter: Megatron's query-group interleaved QKV,
the gate/up halves of linear_fc1) and its e4m3 bytes and scale are stored at their byte offsets
in the bucket. Which tensor a program belongs to comes from a per-program table of tensor indices.

The arithmetic is blocks_triton's per-tensor kernel's: both call the same block scale and e4m3
rounding (quantize_triton.py; tests compare the bytes with the torch reference,
fp8.quantize_torch, which tests/gpu/test_fp8_gpu.py holds the per-tensor kernel to). A block whose scale
is not finite (an inf or nan weight) raises a device flag instead of making the host wait per
tensor: the caller reads it once per sync.

Wide accesses: the compiler vectorises a load or store only as far as it can prove the offsets
aligned, and offsets read from a table prove nothing, so a block went one bf16 element per load and
one byte per store, with 226-254 registers a thread (one block of programs per SM): a small fraction
of HBM bandwidth, as measured on GPU. Each launch now carries VEC,
the largest power of two up to 16 that divides every column count, e4m3 offset and source row
offset in its tables (16 for every weight of a real model), and the kernel multiplies those
offsets back by it (quant_slots), which lets the compiler use 16-byte accesses (~100 registers).
One odd tensor lowers its launch's VEC, never the bytes written.
"""

from __future__ import annotations

import torch

from weightsync.debug import switches
from weightsync.formats.fp8.spec import BLOCK, FP8_MAX, MIN_NORMAL
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

#: int64 fields per row of the tensor table: rows, cols, e4m3 byte offset, scale word offset,
#: first row in the row table, first program
TENSOR_FIELDS = 6
#: the widest access (elements): 16 e4m3 bytes, 16 bf16 elements (two 16-byte accesses)
MAX_VEC = 16
#: rows a program holds at a time (a quarter of a block: quant_slots says why), and its warps
TILE_ROWS = 32
NUM_WARPS = 4


def gpu_conversions(device: torch.device) -> bool:
    """Whether the kernels on `device` round to e4m3 (and the fused write to bfloat16) by the GPU's
    own conversion instructions (sm_89 and later) instead of on the bits: the same codes and values
    for every finite weight in fewer instructions and registers (these kernels are bound by their
    arithmetic, not by memory). The config's `debug.fp8_gpu_convert=false` keeps the bit arithmetic, which the CPU
    interpreter always runs (it has no PTX)."""
    if device.type != "cuda" or not switches().fp8_gpu_convert:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def vec_of(*values: int) -> int:
    """The largest power of two up to MAX_VEC that divides every value: a launch's VEC."""
    v = MAX_VEC
    for x in values:
        while x % v:
            v //= 2
    return v


def _kernel():
    from weightsync.formats.fp8.quantize_triton import quant_slots

    return quant_slots


def launch(
    src_base: torch.Tensor,
    rows: torch.Tensor,
    tensors: torch.Tensor,
    owners: torch.Tensor,
    q_base: torch.Tensor,
    s_base: torch.Tensor,
    vec: int,
    sums: torch.Tensor | None,
    flag: torch.Tensor,
) -> None:
    """Quantize every block `owners` names (int32, one per program) from `src_base` (offsets in
    `rows`, int64 elements) into `q_base` (uint8) and `s_base` (float32 words of the same buffer);
    `vec` divides every column count, e4m3 offset and row offset of the tables (`vec_of`); `flag`
    (int32 [1]) becomes 1 where a block is not finite. `sums` (int64 [programs, 4], `vec` a multiple
    of 4), unless None, gets each block's word sums: of its e4m3 words, then of its scale's word."""
    grid = (owners.numel(),)
    if grid[0] == 0:
        return
    if sums is not None and vec % 4:
        raise ValueError(f"word sums need rows of whole 32-bit words: vec={vec} is not a multiple of 4")
    args = (src_base, rows, tensors, owners, q_base, s_base, flag, flag if sums is None else sums)
    consts = dict(
        BR=BLOCK[0], BC=BLOCK[1], RB=TILE_ROWS, FMAX=FP8_MAX, SMIN=MIN_NORMAL, VEC=vec, SUMS=sums is not None,
        CVT=gpu_conversions(owners.device),
    )  # fmt: skip
    if owners.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        _kernel()[grid](*args, **consts)
        return
    with torch.cuda.device(owners.device):
        _kernel()[grid](*args, **consts, num_warps=NUM_WARPS)
