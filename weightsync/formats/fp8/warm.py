"""Compile the Triton FP8 kernels (blocks_triton.py) at start-up instead of in the first FP8 sync.

Triton compiles a kernel once per specialisation of its arguments: the tensors' dtypes, and for
each integer argument (rows, cols and the block counts) whether it is 1 and whether it is
divisible by 16 (older versions: by 8). Quantizing one small tensor would therefore leave the
first sync to compile the others. Instead every distinct weight shape of the model is mapped onto
a small stand-in whose integer arguments agree with the real ones modulo 16 and in being 1 or not
(`stand_in`), so the stand-ins meet every specialisation the real shapes will, at a few MB each.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from weightsync.bus.plan import TensorMeta
from weightsync.formats.fp8.export import is_quantized
from weightsync.formats.fp8.spec import BLOCK, FP8_DTYPE

#: output dtypes the dequantize kernel has (others go through the torch path)
DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _small(n: int, block: int) -> int:
    """`n` itself up to 17 blocks; beyond, a length of 2..17 blocks with the same count of blocks
    modulo 16 and the same last, partial or full, block (so the same value modulo `block`)."""
    blocks = -(-n // block)
    if blocks <= 17:
        return n
    tail = n - (blocks - 1) * block  # 1..block elements in the last block
    return ((blocks - 2) % 16 + 1) * block + tail  # (blocks - 2) % 16 + 2 blocks: same count mod 16, >= 2


def stand_in(shape: tuple[int, ...]) -> tuple[int, int]:
    """A matrix shape of at most 2176 x 2176 that the kernels specialise exactly as `shape`.

    Each of rows and cols keeps its value modulo 128 (so modulo 16, and 1 stays 1) and its count
    of 128-blocks modulo 16 (a count of 1 stays 1); leading dimensions (stacked experts) only
    change the number of programs, not the compiled kernel.
    """
    *_, rows, cols = shape
    return _small(rows, BLOCK[0]), _small(cols, BLOCK[1])


def _jobs(metas: Iterable[TensorMeta], dtypes=None) -> list[tuple[torch.dtype, tuple[int, int]]]:
    """The distinct (dtype, stand-in shape) of the quantizable tensors among `metas`."""
    jobs = {
        (m.dtype, stand_in(m.shape))
        for m in metas
        if is_quantized(m.name, m.shape) and (dtypes is None or m.dtype in dtypes)
    }
    return sorted(jobs, key=lambda job: (str(job[0]), job[1]))


def _ready(device) -> torch.device | None:
    """The CUDA device to compile for, or None where the kernels are not used (CPU, no triton)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    from weightsync.formats.fp8 import blocks_triton  # lazy: triton comes only with CUDA builds of torch

    return device if blocks_triton.available() else None


def warm_quantize(metas: Iterable[TensorMeta], device) -> float:
    """Compile the quantize kernel for every (dtype, shape class) of `metas`' quantized tensors on
    `device`; seconds it took (0.0 off-GPU or without triton)."""
    device = _ready(device)
    if device is None:
        return 0.0
    from weightsync.formats.fp8 import blocks_triton

    t0 = time.perf_counter()
    for dtype, (rows, cols) in _jobs(metas):
        blocks_triton.quantize(torch.zeros(rows, cols, dtype=dtype, device=device))
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_quantize_slots(device, dtypes=(torch.bfloat16, torch.float32)) -> float:
    """Compile the quantize-into-slots kernel (quantize_slots_triton.py) for parameters of `dtypes` on
    `device`; seconds it took (0.0 off-GPU or without triton). Its arguments are all pointers, so one
    compile per source dtype covers every shape whose columns and offsets are multiples of 16 (a
    real model's: the launch's VEC, quantize_slots_triton.py); an odd layout compiles its own at its
    first sync."""
    device = _ready(device)
    if device is None:
        return 0.0
    from weightsync.formats.fp8 import quantize_slots

    t0 = time.perf_counter()
    for dtype in dtypes:
        flat = torch.zeros(1024, dtype=torch.uint8, device=device)
        src = torch.zeros(16, 16, dtype=dtype, device=device)  # an allocation: rows 16-aligned, as a model's
        (stand_in,) = quantize_slots.stand_ins([(16, 16)])
        weight = quantize_slots.SlotWeight("warm-up", 0, 256, 0, stand_in, [(stand_in, src)])
        quantize_slots.plan([flat], [weight], use_kernel=True).run()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_fused_write(device, dtypes=(torch.bfloat16, torch.float32)) -> float:
    """Compile the kernel that writes FP8 weights dequantized straight into an engine's parameters
    (write_slots.py: a colocated ipc trainer_writes sync from the actor's own buckets) for sources of
    `dtypes` on `device`; seconds it took (0.0 off-GPU or without triton). Pointers only: one compile
    per source dtype for the launch's VEC of a real model (16); an odd layout compiles its own."""
    device = _ready(device)
    if device is None:
        return 0.0
    from weightsync.formats.fp8 import quantize_slots, write_slots

    t0 = time.perf_counter()
    for dtype in dtypes:
        src = torch.zeros(16, 16, dtype=dtype, device=device)  # an allocation: rows 16-aligned, as a model's
        out = torch.empty(16, 16, dtype=torch.bfloat16, device=device)
        (stand_in,) = quantize_slots.stand_ins([(16, 16)])
        weight = quantize_slots.SlotWeight("warm-up", 0, 256, 0, stand_in, [(stand_in, src)])
        write_slots.plan([weight], [out], 1, use_kernel=True).run()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_dequantize_into_params(device) -> float:
    """Compile the fused dequantize-and-checksum kernel (dequantize_slots_triton.py) on `device`; seconds
    it took (0.0 off-GPU or without triton). Pointers and one unspecialised count: one compile, for
    buckets whose FP8 weights' columns and offsets are multiples of 16 (the launch's VEC: a real
    model's); an odd layout compiles its own at its first sync."""
    device = _ready(device)
    if device is None:
        return 0.0
    from weightsync.bus.plan import make_manifest
    from weightsync.formats.fp8.dequantize_slots import FusedDequant
    from weightsync.formats.fp8.spec import SCALE_DTYPE

    t0 = time.perf_counter()
    metas = [TensorMeta("w_scale_inv", (1, 1), SCALE_DTYPE), TensorMeta("w", (4, 16), FP8_DTYPE)]
    (plan,) = make_manifest(metas, version=0, sync_id="warm-up", bucket_bytes=1 << 20).buckets
    buf = torch.zeros(plan.nbytes, dtype=torch.uint8, device=device)
    out = torch.empty(4, 16, dtype=torch.bfloat16, device=device)
    fused = FusedDequant(use_kernel=True)
    fused.copy(plan, buf, [None, out], set())
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_dequantize(metas: Iterable[TensorMeta], device) -> float:
    """Compile the dequantize kernel for every (output dtype, shape class) of `metas`' quantizable
    tensors (an engine's parameters: the dtypes it receives dequantized weights in) on `device`;
    seconds it took (0.0 off-GPU or without triton)."""
    device = _ready(device)
    if device is None:
        return 0.0
    from weightsync.formats.fp8 import blocks_triton

    t0 = time.perf_counter()
    for dtype, (rows, cols) in _jobs(metas, DEQUANT_DTYPES):
        q = torch.zeros(rows, cols, dtype=torch.uint8, device=device).view(FP8_DTYPE)
        s = torch.ones(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]), dtype=torch.float32, device=device)
        blocks_triton.dequantize(q, s, dtype)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0
