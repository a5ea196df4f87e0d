"""The `ws-sum64-v1` bucket checksum as one fused Triton kernel, for buffers on a CUDA GPU.

torch computes the two sums with a widening reduction plus an int32 temporary for the squares
(measured on GPU slow enough to halve an NCCL sync's throughput); this kernel reads each word
once and keeps both accumulators in registers. Integer addition wraps, so per-program partial
sums added in any order give the value the CPU path gives, bit for bit (tests/gpu/test_bus_gpu.py).
Triton ships with CUDA builds of torch, not with the CPU build: callers fall back to torch when
`available()` is false.
"""

from __future__ import annotations

import functools

import torch

from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

_BLOCK = 4096  # words per inner step of one program
_STEPS = 16  # inner steps per program: 256 KiB of the buffer each


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sum64(words_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # buckets may exceed 2**31 words' worth of offsets
        start = pid * BLOCK * STEPS
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        for i in range(STEPS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            w = tl.load(words_ptr + offs, mask=offs < n_words, other=0)
            acc1 += w.to(tl.int64)
            acc2 += (w * w).to(tl.int64)  # the square wraps in int32, as on the CPU path
        tl.store(out_ptr + pid * 2, tl.sum(acc1, axis=0))
        tl.store(out_ptr + pid * 2 + 1, tl.sum(acc2, axis=0))

    return sum64


@functools.lru_cache(maxsize=1)
def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_sum64(src_ptr, dst_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        start = pid * BLOCK * STEPS
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        for i in range(STEPS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n_words
            w = tl.load(src_ptr + offs, mask=mask, other=0)
            tl.store(dst_ptr + offs, w, mask=mask)
            acc1 += w.to(tl.int64)
            acc2 += (w * w).to(tl.int64)
        tl.store(out_ptr + pid * 2, tl.sum(acc1, axis=0))
        tl.store(out_ptr + pid * 2 + 1, tl.sum(acc2, axis=0))

    return copy_sum64


def word_sums(words: torch.Tensor) -> torch.Tensor:
    """int64 tensor [sum of words, sum of wrapped squares] of a contiguous int32 CUDA tensor."""
    n = words.numel()
    per_program = _BLOCK * _STEPS
    programs = max(1, -(-n // per_program))
    partial = torch.empty(programs * 2, dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device):
        _kernel()[(programs,)](words, partial, n, BLOCK=_BLOCK, STEPS=_STEPS)
    return partial.view(programs, 2).sum(dim=0)


def copy_word_sums(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy contiguous int32 CUDA `src` into `dst` and return word_sums(src), reading src once."""
    n = src.numel()
    per_program = _BLOCK * _STEPS
    programs = max(1, -(-n // per_program))
    partial = torch.empty(programs * 2, dtype=torch.int64, device=src.device)
    with torch.cuda.device(src.device):
        _copy_kernel()[(programs,)](src, dst, partial, n, BLOCK=_BLOCK, STEPS=_STEPS)
    return partial.view(programs, 2).sum(dim=0)


@functools.lru_cache(maxsize=1)
def _many_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def many_sum64(table_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        # Grid (chunks of the longest buffer, buffers); the table row of each buffer is (address,
        # word count). A chunk past its buffer's end stores zeros, so every partial is written.
        pid = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        chunks = tl.num_programs(0).to(tl.int64)
        src = tl.load(table_ptr + b * 2).to(tl.pointer_type(tl.int32))
        n = tl.load(table_ptr + b * 2 + 1)
        start = pid * BLOCK * STEPS
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        for i in range(STEPS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            w = tl.load(src + offs, mask=offs < n, other=0)
            acc1 += w.to(tl.int64)
            acc2 += (w * w).to(tl.int64)
        tl.store(out_ptr + (b * chunks + pid) * 2, tl.sum(acc1, axis=0))
        tl.store(out_ptr + (b * chunks + pid) * 2 + 1, tl.sum(acc2, axis=0))

    return many_sum64


def many_word_sums(table: torch.Tensor, max_words: int) -> torch.Tensor:
    """int64 [buffers, 2]: the word sums of every buffer of `table` (rows of (address of its
    int32 words, word count), on the GPU, `max_words` the longest count) in one launch, where one
    launch per buffer costs tens of microseconds of Python each."""
    per_program = _BLOCK * _STEPS
    chunks = max(1, -(-max_words // per_program))
    buffers = table.shape[0]
    partial = torch.empty(buffers * chunks * 2, dtype=torch.int64, device=table.device)
    with torch.cuda.device(table.device):
        _many_kernel()[(chunks, buffers)](table, partial, BLOCK=_BLOCK, STEPS=_STEPS)
    return partial.view(buffers, chunks, 2).sum(dim=1)


@functools.lru_cache(maxsize=1)
def _scatter_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scatter_sum64(src_ptr, table_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        # One row of the table per program: (first source word, word count <= BLOCK * STEPS,
        # destination address or 0 for words that are only summed: the gaps between tensors).
        pid = tl.program_id(0).to(tl.int64)
        src_off = tl.load(table_ptr + pid * 3)
        n = tl.load(table_ptr + pid * 3 + 1)
        dst_addr = tl.load(table_ptr + pid * 3 + 2)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        for i in range(STEPS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            w = tl.load(src_ptr + src_off + offs, mask=mask, other=0)
            if dst_addr != 0:
                tl.store(dst_addr.to(tl.pointer_type(tl.int32)) + offs, w, mask=mask)
            acc1 += w.to(tl.int64)
            acc2 += (w * w).to(tl.int64)
        tl.store(out_ptr + pid * 2, tl.sum(acc1, axis=0))
        tl.store(out_ptr + pid * 2 + 1, tl.sum(acc2, axis=0))

    return scatter_sum64


def scatter_table(regions: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """The work table of `scatter_word_sums` for `regions` (first word, word count, destination
    address or 0), cut into rows of at most one program's words; built once per layout."""
    per_program = _BLOCK * _STEPS
    rows = []
    for start, count, addr in regions:
        for k in range(0, count, per_program):
            rows.append((start + k, min(per_program, count - k), addr + 4 * k if addr else 0))
    return torch.tensor(rows or [(0, 0, 0)], dtype=torch.int64).to(device)


def scatter_word_sums(src_words: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Copy each region of `table` out of `src_words` to its address and return the word sums of
    every word the table names: one launch for a whole bucket, whatever its number of tensors."""
    programs = table.shape[0]
    partial = torch.empty(programs * 2, dtype=torch.int64, device=src_words.device)
    if src_words.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        _scatter_kernel()[(programs,)](src_words, table, partial, BLOCK=_BLOCK, STEPS=_STEPS)
        return partial.view(programs, 2).sum(dim=0)
    with torch.cuda.device(src_words.device):
        _scatter_kernel()[(programs,)](src_words, table, partial, BLOCK=_BLOCK, STEPS=_STEPS)
    return partial.view(programs, 2).sum(dim=0)
