"""fp8/write_slots.py: FP8 weights quantized and dequantized in one pass into an engine's parameters store the
values fp8.quantize_torch then fp8.dequantize_torch give (bf16 and float32 parameters, bf16 and fp32
sources, rows gathered from strided views as Megatron's QKV and gate/up, a scale slot in the bucket
before its weight's), return exactly the word sums of the FP8 and scale slots the quantizer writes into
the buckets (so the bucket checksums equal any other path's), raise the one flag for a non-finite block
and name it, and decline what they cannot sum or address. The torch path runs everywhere; the Triton
kernel through Triton's interpreter where triton is installed."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.fp8_weights import block_test_weights, bucket_layout
from tests.support.triton_cpu import rerun_under_interpreter
from trainer_svc.actor.megatron.rules.transforms import GATE_UP, QKV
from weightsync.bus.copy.checksum import word_sums
from weightsync.formats.fp8 import blocks as fp8
from weightsync.formats.fp8 import quantize_slots, write_slots
from weightsync.model_spec import Dims

KERNEL_ENV = "FP8_WRITE_KERNEL"
POISON = 0xAB
# columns multiples of 4 (the sums need rows of whole words); of 16 and not; lead dims; partial blocks
SHAPES = [(1, 4), (7, 200), (129, 256), (300, 128), (128, 128), (3, 130, 144), (2, 1, 132), (260, 300)]


@pytest.fixture
def use_kernel():
    """True only in the subprocess of test_the_kernel_writes_the_same_values (TRITON_INTERPRET=1)."""
    return os.environ.get(KERNEL_ENV) == "1"


def test_the_kernel_writes_the_same_values():
    """Every other test of this file again, with the Triton kernel run by Triton's interpreter."""
    rerun_under_interpreter(__file__, "the_kernel_writes", KERNEL_ENV)


def _slot_sums(weights, sizes) -> torch.Tensor:
    """What the quantizer (torch path) writes into poisoned buckets, summed over its FP8 and scale slots."""
    flats = [torch.full((n,), POISON, dtype=torch.uint8) for n in sizes]
    q = quantize_slots.plan(flats, weights, use_kernel=False)
    q.run()
    out = torch.zeros(len(flats), 2, dtype=torch.int64)
    for b, ranges in enumerate(q.slot_ranges()):
        for start, end in ranges:
            out[b] += word_sums(flats[b][start:end].view(torch.int32))
    return out


def _want(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q, s = fp8.quantize_torch(t)
    return fp8.dequantize_torch(q, s, dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["randn", "heavy", "zeros", "huge"])
def test_every_shape_is_quantize_then_dequantize_bit_for_bit_with_the_slots_sums(use_kernel, kind, src, out):
    named = [(f"w{i}", block_test_weights(s, kind, 200 + i, src)) for i, s in enumerate(SHAPES)]
    places, size = bucket_layout(SHAPES, 40)
    weights = [
        quantize_slots.SlotWeight(n, 0, q_off, s_off, si, [(si, t)])
        for (n, t), si, (s_off, q_off) in zip(named, quantize_slots.stand_ins(SHAPES), places)
    ]
    dests = [torch.full(t.shape, float("nan"), dtype=out) for _, t in named]
    f = write_slots.plan(weights, dests, 1, use_kernel=use_kernel)
    assert f is not None and f.use_kernel is use_kernel
    sums = f.run()
    for (n, t), d in zip(named, dests):
        assert torch.equal(_bits(d), _bits(_want(t, out))), n
    assert torch.equal(sums.cpu(), _slot_sums(weights, [size]))
    assert f.finite() and f.first_non_finite() is None
    if use_kernel:
        assert len(f.launches) == 1 and f.launches[0].vec == 4  # 300 and 132 columns: 4 per access


def test_strided_rows_two_buckets_a_scale_before_its_weight_and_a_rerun(use_kernel):
    """QKV's query-group interleave and gate/up's halves as Megatron stores them, in two buckets whose
    first ends with the scale of the second's first weight; bf16 and fp32 sources (one launch each); a
    rerun after the sources changed in place writes the new values and sums."""
    d = Dims(
        num_layers=1, hidden_size=160, num_heads=8, num_query_groups=2, head_dim=72, ffn_hidden_size=12, vocab_size=90
    )
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(2 * (4 + 2) * 72, 160, generator=g) * 0.05).to(torch.bfloat16)
    fc1 = torch.randn(2 * 300, 128, generator=g) * 3

    def hf():
        return [*zip(("q", "k", "v"), QKV.to_hf(qkv, d)), *zip(("gate", "up"), GATE_UP.to_hf(fc1, d))]

    shapes = [tuple(t.shape) for _, t in hf()]
    p0, n0 = bucket_layout(shapes[:3], 8)
    gate_scale = n0 + 1 + (-(n0 + 1)) % 4  # the gate's scale ends bucket 0
    n0 = gate_scale + 4 * 3 * 1 + 2
    p1, n1 = bucket_layout(shapes[3:], 0)
    si0, si1 = quantize_slots.stand_ins(shapes[:3]), quantize_slots.stand_ins(shapes[3:])
    weights = [
        quantize_slots.SlotWeight(n, 0, q_off, s_off, si, [pair])
        for (n, _), si, (s_off, q_off), pair in zip(hf()[:3], si0, p0, QKV.hf_copies(qkv, si0, d))
    ]
    pairs = GATE_UP.hf_copies(fc1, si1, d)
    weights.append(quantize_slots.SlotWeight("gate", 1, p1[0][1], gate_scale, si1[0], [pairs[0]], scale_bucket=0))
    weights.append(quantize_slots.SlotWeight("up", 1, p1[1][1], p1[1][0], si1[1], [pairs[1]]))
    dests = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    f = write_slots.plan(weights, dests, 2, use_kernel=use_kernel)
    assert f is not None
    for _ in range(2):
        sums = f.run()
        for (n, t), dst in zip(hf(), dests):
            assert torch.equal(_bits(dst), _bits(_want(t.contiguous(), torch.bfloat16))), n
        assert torch.equal(sums.cpu(), _slot_sums(weights, [n0, n1]))
        with torch.no_grad():
            qkv.mul_(-3)
            fc1.add_(1)
    if use_kernel:
        assert len(f.launches) == 2  # a bf16 and an fp32 source


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_block_raises_the_flag_and_is_named(use_kernel, bad):
    named = [(n, block_test_weights((260, 300), "randn", i)) for i, n in enumerate(("a.weight", "b.weight"))]
    named[1][1][200, 150] = bad
    places, _ = bucket_layout([(260, 300)] * 2, 40)
    weights = [
        quantize_slots.SlotWeight(n, 0, q_off, s_off, si, [(si, t)])
        for (n, t), si, (s_off, q_off) in zip(named, quantize_slots.stand_ins([(260, 300)] * 2), places)
    ]
    f = write_slots.plan(weights, [torch.empty(260, 300, dtype=torch.bfloat16) for _ in named], 1, use_kernel)
    f.run()
    assert not f.finite()
    err = f.first_non_finite()
    assert str(err) == str(fp8.non_finite_error(fp8.quantize_torch(named[1][1])[1], "b.weight"))
    named[1][1][200, 150] = 1.0  # the next run starts with the flag down
    f.run()
    assert f.finite()


def test_what_cannot_be_summed_or_addressed_is_declined(use_kernel):
    (si,) = quantize_slots.stand_ins([(8, 6)])
    w = torch.randn(8, 6)
    odd = quantize_slots.SlotWeight("x", 0, 256, 0, si, [(si, w)])  # 6 columns: rows are not whole words
    assert write_slots.plan([odd], [torch.empty(8, 6)], 1, use_kernel) is None
    (si,) = quantize_slots.stand_ins([(8, 8)])
    w = torch.randn(8, 8)
    ok = quantize_slots.SlotWeight("x", 0, 256, 0, si, [(si, w)])
    assert write_slots.plan([ok], [torch.empty(8, 8)], 1, use_kernel) is not None
    assert write_slots.plan([ok], [torch.empty(8, 4)], 1, use_kernel) is None  # another shape
    assert write_slots.plan([ok], [torch.empty(8, 16)[:, :8]], 1, use_kernel) is None  # not contiguous
    assert write_slots.plan([quantize_slots.SlotWeight("x", 0, 258, 0, si, [(si, w)])], [torch.empty(8, 8)], 1) is None
    if use_kernel:
        assert write_slots.plan([ok], [torch.empty(8, 8, dtype=torch.float16)], 1, True) is None  # not written
        assert write_slots.plan([ok], [torch.empty(8 * 8 + 1, dtype=torch.bfloat16)[1:].view(8, 8)], 1, True) is None
    with pytest.raises(ValueError, match="2 FP8 weights, 1 destinations"):
        write_slots.plan([ok, ok], [torch.empty(8, 8)], 1)
