"""fp8/quantize_slots.py: weights quantized straight into bucket slots write the bytes fp8.quantize writes for
the same weights (odd shapes, stacked experts, tiny tensors, zero / denormal / huge blocks, bf16 and
fp32 sources, rows gathered from strided views as Megatron's QKV and gate/up), leave every other byte
of the bucket alone, raise the one flag for a non-finite block and name it, and decline what is not
whole rows. The torch path runs everywhere; the Triton kernel through Triton's interpreter where
triton is installed (tests/gpu/test_fp8_slots_gpu.py runs it compiled)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.support.fp8_weights import block_test_weights
from tests.support.triton_cpu import rerun_under_interpreter
from trainer_svc.actor.megatron.rules.transforms import GATE_UP, QKV
from weightsync.formats.fp8 import blocks as fp8
from weightsync.formats.fp8 import quantize_slots
from weightsync.model_spec import Dims

POISON = 0xAB
KERNEL_ENV = "FP8_SLOTS_KERNEL"
SHAPES = [(1, 1), (1, 5), (7, 200), (129, 257), (300, 128), (128, 128), (1000, 3), (3, 130, 140), (2, 1, 129)]


class Bucket:
    """One flat bucket (poisoned) with a scale slot and a weight slot per tensor, 256-aligned as plans are."""

    def __init__(self, shapes, start: int = 0):
        self.places = []
        pos = start
        for shape in shapes:
            s_off = -(-pos // 256) * 256
            n_s = math.prod(fp8.scale_shape(shape))
            q_off = -(-(s_off + 4 * n_s) // 256) * 256
            self.places.append((s_off, q_off))
            pos = q_off + math.prod(shape)
        self.flat = torch.full((pos + 3,), POISON, dtype=torch.uint8)  # a tail that is not a whole word

    def weights(self, bucket: int, named, sources_of) -> list[quantize_slots.SlotWeight]:
        shapes = [tuple(t.shape) for _, t in named]
        out = []
        for (name, t), si, (s_off, q_off) in zip(named, quantize_slots.stand_ins(shapes), self.places):
            out.append(quantize_slots.SlotWeight(name, bucket, q_off, s_off, si, sources_of(si, t)))
        return out

    def expected(self, named) -> torch.Tensor:
        want = torch.full_like(self.flat, POISON)
        for (_, t), (s_off, q_off) in zip(named, self.places):
            q, s = fp8.quantize(t, check_finite=False)
            want[q_off : q_off + q.numel()] = q.reshape(-1).view(torch.uint8)
            want[s_off : s_off + 4 * s.numel()] = s.reshape(-1).view(torch.uint8)
        return want


def _whole(si, t):
    return [(si, t)]


@pytest.fixture
def use_kernel():
    """False: the torch path. True only in the subprocess of test_the_kernel_writes_the_same_bytes,
    started with TRITON_INTERPRET=1: the interpreter must be on before triton is first imported
    (triton's own reductions, tl.max among them, are decorated then), which a fixture in this
    process cannot guarantee."""
    return os.environ.get(KERNEL_ENV) == "1"


def test_the_kernel_writes_the_same_bytes():
    """Every other test of this file again, with the Triton kernel run by Triton's interpreter."""
    rerun_under_interpreter(__file__, "the_kernel_writes", KERNEL_ENV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["randn", "heavy", "zeros", "huge"])
def test_every_shape_in_one_bucket_is_quantize_byte_for_byte(use_kernel, kind, dtype):
    named = [(f"w{i}", block_test_weights(s, kind, 100 + i, dtype)) for i, s in enumerate(SHAPES)]
    b = Bucket([tuple(t.shape) for _, t in named], start=40)
    q = quantize_slots.plan([b.flat], b.weights(0, named, _whole), use_kernel=use_kernel)
    assert q is not None and q.use_kernel is use_kernel
    q.run()
    assert torch.equal(b.flat, b.expected(named))  # slots exact, gaps and tail untouched
    assert q.finite() and q.first_non_finite() is None
    if use_kernel:
        assert len(q.launches) == 1  # one launch for the whole bucket
        assert q.launches[0].vec == 1 and q.word_sums() is None  # odd columns: one element per access
        # the aligned shapes alone (columns and 256-byte slots multiples of 16): 16 per access
        wide = [(i, s) for i, s in enumerate(SHAPES) if s[-1] % 16 == 0]
        named = [named[i] for i, _ in wide]
        b = Bucket([s for _, s in wide], start=40)
        q = quantize_slots.plan([b.flat], b.weights(0, named, _whole), use_kernel=use_kernel)
        q.run()
        assert q.launches[0].vec == 16 and torch.equal(b.flat, b.expected(named))


def test_rows_gathered_from_strided_views_and_two_buckets_and_dtypes(use_kernel):
    """QKV's query-group interleave and gate/up's halves as Megatron stores them, in two buckets,
    bf16 and fp32 sources side by side: one launch per (bucket, source dtype); a rerun after the
    sources changed in place writes the new bytes."""
    d = Dims(
        num_layers=1, hidden_size=160, num_heads=8, num_query_groups=2, head_dim=72, ffn_hidden_size=12, vocab_size=90
    )
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(2 * (4 + 2) * 72, 160, generator=g) * 0.05).to(torch.bfloat16)
    fc1 = torch.randn(2 * 300, 130, generator=g) * 3
    hf = [*zip(("q", "k", "v"), QKV.to_hf(qkv, d)), *zip(("gate", "up"), GATE_UP.to_hf(fc1, d))]
    named = [(n, t.contiguous()) for n, t in hf]
    b0, b1 = Bucket([tuple(t.shape) for _, t in named[:3]], 8), Bucket([tuple(t.shape) for _, t in named[3:]])
    si0 = quantize_slots.stand_ins([tuple(t.shape) for _, t in named[:3]])
    si1 = quantize_slots.stand_ins([tuple(t.shape) for _, t in named[3:]])
    weights = [
        quantize_slots.SlotWeight(n, 0, q_off, s_off, si, [pair])
        for (n, _), si, (s_off, q_off), pair in zip(named[:3], si0, b0.places, QKV.hf_copies(qkv, si0, d))
    ] + [
        quantize_slots.SlotWeight(n, 1, q_off, s_off, si, [pair])
        for (n, _), si, (s_off, q_off), pair in zip(named[3:], si1, b1.places, GATE_UP.hf_copies(fc1, si1, d))
    ]
    q = quantize_slots.plan([b0.flat, b1.flat], weights, use_kernel=use_kernel)
    assert q is not None
    q.run()
    assert torch.equal(b0.flat, b0.expected(named[:3])) and torch.equal(b1.flat, b1.expected(named[3:]))
    if use_kernel:
        assert len(q.launches) == 2
    with torch.no_grad():
        qkv.mul_(-3)
        fc1.add_(1)
    q.run()
    named = [(n, t.contiguous()) for n, t in [*zip("qkv", QKV.to_hf(qkv, d)), *zip("gu", GATE_UP.to_hf(fc1, d))]]
    assert torch.equal(b0.flat, b0.expected(named[:3])) and torch.equal(b1.flat, b1.expected(named[3:]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_block_raises_the_flag_and_is_named(use_kernel, bad):
    named = [(n, block_test_weights((260, 300), "randn", i)) for i, n in enumerate(("a.weight", "b.weight"))]
    named[1][1][200, 150] = bad
    b = Bucket([tuple(t.shape) for _, t in named])
    q = quantize_slots.plan([b.flat], b.weights(0, named, _whole), use_kernel=use_kernel)
    q.run()
    assert not q.finite()
    err = q.first_non_finite()
    assert str(err) == str(fp8.non_finite_error(fp8.quantize_torch(named[1][1])[1], "b.weight"))
    assert "block [1, 1]" in str(err)
    named[1][1][200, 150] = 1.0  # the next run starts with the flag down
    q.run()
    assert q.finite() and torch.equal(b.flat, b.expected(named))


def test_what_is_not_whole_rows_is_declined():
    w = torch.randn(8, 6)
    b = Bucket([(8, 6)])
    (si,) = quantize_slots.stand_ins([(8, 6)])
    halves = [(si[:, :3], w[:, :3]), (si[:, 3:], w[:, 3:])]  # a column split
    assert quantize_slots.plan([b.flat], [quantize_slots.SlotWeight("x", 0, *b.places[0][::-1], si, halves)]) is None
    rows_missing = [(si[:4], w[:4])]
    assert (
        quantize_slots.plan([b.flat], [quantize_slots.SlotWeight("x", 0, *b.places[0][::-1], si, rows_missing)]) is None
    )
    twice = [(si, w), (si[:1], w[:1])]
    assert quantize_slots.plan([b.flat], [quantize_slots.SlotWeight("x", 0, *b.places[0][::-1], si, twice)]) is None
    transposed = [(si, torch.randn(6, 8).t())]  # rows not contiguous in the source
    assert (
        quantize_slots.plan([b.flat], [quantize_slots.SlotWeight("x", 0, *b.places[0][::-1], si, transposed)]) is None
    )
    ints = [(si, torch.ones(8, 6, dtype=torch.int32))]
    assert quantize_slots.plan([b.flat], [quantize_slots.SlotWeight("x", 0, *b.places[0][::-1], si, ints)]) is None
    ok = quantize_slots.plan([b.flat], [quantize_slots.SlotWeight("x", 0, *b.places[0][::-1], si, [(si, w)])])
    assert ok is not None and not ok.use_kernel  # a CPU buffer: the torch path unless asked


def test_a_scale_in_the_bucket_before_its_weight(use_kernel):
    """The exporter sends `X_scale_inv` right before `X`: a plan may end one bucket with the scale and
    open the next with the weight. One launch for the pair, each part in its own bucket."""
    w = block_test_weights((260, 300), "heavy", 5, torch.bfloat16)
    (si,) = quantize_slots.stand_ins([(260, 300)])
    scales = torch.full((512 + 4 * 3 * 3 + 1,), POISON, dtype=torch.uint8)  # the scale slot at byte 512
    weights = torch.full((w.numel() + 2,), POISON, dtype=torch.uint8)  # the weight slot at byte 0
    q = quantize_slots.plan(
        [scales, weights], [quantize_slots.SlotWeight("x", 1, 0, 512, si, [(si, w)], scale_bucket=0)], use_kernel
    )
    q.run()
    qq, ss = fp8.quantize(w)
    want_s, want_w = torch.full_like(scales, POISON), torch.full_like(weights, POISON)
    want_s[512 : 512 + 36] = ss.reshape(-1).view(torch.uint8)
    want_w[: w.numel()] = qq.reshape(-1).view(torch.uint8)
    assert torch.equal(scales, want_s) and torch.equal(weights, want_w)
    assert torch.equal(q.scales(q.weights[0]), ss)


def test_the_slots_word_sums_complete_each_bucket_checksum(use_kernel):
    """The sums the quantizer keeps of the e4m3 and scale words it wrote (`word_sums`, over
    `slot_ranges`) plus a read of every other word give each bucket's `bucket_checksum`: poisoned
    gaps, a tail that is not a whole word, and a scale whose slot ends the bucket before its weight's
    (its word counted there). Odd columns (words across rows): no sums, the bucket is read whole."""
    from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum
    from weightsync.bus.copy.checksum_regions import KnownSums

    shapes = [(300, 128), (128, 128), (3, 130, 64), (260, 16)]
    named = [(f"w{i}", block_test_weights(s, "heavy", 30 + i, torch.bfloat16)) for i, s in enumerate(shapes)]
    b = Bucket([tuple(t.shape) for _, t in named[:3]], start=40)
    w = named[3][1]
    (si,) = quantize_slots.stand_ins([(260, 16)])
    nxt = torch.full((w.numel() + 3,), POISON, dtype=torch.uint8)  # its weight opens the next bucket
    scale_at = -(-b.flat.numel() // 256) * 256
    first = torch.full((scale_at + 4 * 3 + 2,), POISON, dtype=torch.uint8)  # the scale ends this one
    first[: b.flat.numel()] = b.flat
    weights = b.weights(0, named[:3], _whole) + [quantize_slots.SlotWeight("w3", 1, 0, scale_at, si, [(si, w)], 0)]
    q = quantize_slots.plan([first, nxt], weights, use_kernel=use_kernel)
    q.run()
    assert q.word_sums() is not None and q.slot_ranges()[1] == [(0, w.numel())]
    got = InFlightChecksums([first, nxt], KnownSums(q.word_sums(), q.slot_ranges())).values()
    assert got == [bucket_checksum(first), bucket_checksum(nxt)]
    odd = Bucket([(7, 200), (129, 257)])
    ws = [(f"o{i}", block_test_weights(s, "randn", i, torch.bfloat16)) for i, s in enumerate([(7, 200), (129, 257)])]
    q = quantize_slots.plan([odd.flat], odd.weights(0, ws, _whole), use_kernel=use_kernel)
    q.run()
    assert q.word_sums() is None
