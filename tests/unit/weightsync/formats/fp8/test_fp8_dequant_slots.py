"""fp8/dequantize_slots.py: a received block-FP8 bucket written into an engine's parameters with its
checksum in one launch gives the parameters the per-tensor path gives (receive.Dequantizer, bit
for bit, bf16 and fp32 parameters) and the bucket's `bucket_checksum`, over buckets that split a
scale from its weight, odd shapes (rows that are not whole words, a 16-bit tensor ending mid-word,
stacked experts), and declines what it cannot write. The torch path runs everywhere; the Triton
kernel through Triton's interpreter in a subprocess where triton is installed (as test_fp8_slots.py)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.triton_cpu import rerun_under_interpreter
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.layout import ManifestCache
from weightsync.bus.pack import pack_bucket
from weightsync.bus.plan import TensorMeta
from weightsync.formats.fp8.dequantize_slots import FusedDequant
from weightsync.formats.fp8.export import export_metas, export_tensors
from weightsync.formats.fp8.receive import Dequantizer
from weightsync.formats.fp8.spec import BLOCK_FP8, FP8_DTYPE

KERNEL_ENV = "FP8_DEQUANT_SLOTS_KERNEL"
TENSORS = [
    ("model.embed_tokens.weight", (50, 64)),
    ("model.layers.0.input_layernorm.weight", (129,)),  # 258 bytes: ends mid-word
    ("model.layers.0.self_attn.q_proj.weight", (129, 260)),
    ("model.layers.0.self_attn.q_proj.bias", (129,)),
    ("model.layers.0.self_attn.k_proj.weight", (70, 130)),  # rows are not whole words
    ("model.layers.0.mlp.down_proj.weight", (300, 128)),
    ("model.layers.0.mlp.experts.gate_up_proj", (3, 130, 64)),
    ("model.layers.0.mlp.up_proj.weight", (1, 5)),
    ("model.norm.weight", (64,)),
]


@pytest.fixture
def use_kernel():
    """True only in the subprocess of test_the_kernel_gives_the_same_parameters (see test_fp8_slots.py)."""
    return os.environ.get(KERNEL_ENV) == "1"


def test_the_kernel_gives_the_same_parameters():
    """Every other test of this file again, with the Triton kernel run by Triton's interpreter."""
    rerun_under_interpreter(__file__, "the_kernel_gives", KERNEL_ENV)


def _sync(bucket_bytes: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    named = []
    for i, (name, shape) in enumerate(TENSORS):
        w = torch.randn(shape, generator=g) * (0.02 if i % 2 else 3.0)
        if i == 2:
            w[:128, :128] = 0  # a zero block: scale 1
        named.append((name, w))
    plain = [TensorMeta(n, tuple(t.shape), torch.float32) for n, t in named]
    m = ManifestCache().manifest(
        export_metas(plain), version=1, sync_id="s", bucket_bytes=bucket_bytes, quantization=BLOCK_FP8
    )
    it = iter(export_tensors(named))
    bufs = []
    for plan in m.buckets:
        buf = torch.full((plan.nbytes + 8,), 0x5A, dtype=torch.uint8)  # bytes past the bucket: never read
        bufs.append(pack_bucket(plan, (next(it) for _ in plan.slots), buf))
    return m, bufs


def _params(dtype) -> dict[str, torch.Tensor]:
    """NaN-filled parameters: the FP8 weights' in `dtype`, the rest in bf16, the dtype they travel in
    (a parameter of another dtype would need a cast: the per-tensor path's)."""
    quantized = {
        m.name for m in export_metas([TensorMeta(n, s, torch.float32) for n, s in TENSORS]) if m.dtype == FP8_DTYPE
    }
    return {n: torch.full(s, float("nan"), dtype=dtype if n in quantized else torch.bfloat16) for n, s in TENSORS}


def _dests(plan, params):
    return [None if s.meta.name.endswith("_scale_inv") else params[s.meta.name] for s in plan.slots]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 40_000, 3_000])
def test_buckets_land_as_the_per_tensor_path_lands_them(use_kernel, dtype, bucket_bytes):
    m, bufs = _sync(bucket_bytes, seed=bucket_bytes)
    if bucket_bytes < 1 << 20:
        where = {s.meta.name: b.index for b in m.buckets for s in b.slots}
        assert any(where[n] != where[n[: -len("_scale_inv")]] for n in where if n.endswith("_scale_inv"))
    # the per-tensor path: every tensor through the Dequantizer into a fresh parameter
    want = _params(dtype)
    deq = Dequantizer({n: p.dtype for n, p in want.items()})
    for plan, buf in zip(m.buckets, bufs):
        from weightsync.bus.pack import unpack_bucket

        for name, t in deq(unpack_bucket(plan, buf)):
            want[name].copy_(t)
    deq.check_complete()
    got = _params(dtype)
    fused = FusedDequant(use_kernel=use_kernel)
    for rep in range(2):  # the second sync reuses the tables and held scales
        held = fused.begin(m)
        for plan, buf in zip(m.buckets, bufs):
            ours = fused.copy(plan, buf, _dests(plan, got), held, wait=rep == 0)
            assert ours is not None, plan.index
            value = ours if rep == 0 else ours.value()
            assert value == bucket_checksum(buf[: plan.nbytes]), plan.index
        for name in want:
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (name, rep)
        for p in got.values():
            p.fill_(float("nan"))
    if use_kernel and bucket_bytes == 1 << 20:
        # odd columns (up_proj's 5): one element per access; word runs 4 words per access where
        # their offsets allow (a norm of 64), one where not (the 129-element norm)
        ((words, _, _, vec),) = [p.tables for p in fused._plans.values()]
        assert vec == 1 and set(words[:, 4].tolist()) == {0, 1}, (vec, words)


def test_what_it_cannot_write_is_declined_and_the_per_tensor_load_gets_the_held_scales(use_kernel):
    m, bufs = _sync(3_000, seed=1)
    fused = FusedDequant(use_kernel=use_kernel)
    params = _params(torch.bfloat16)
    # a weight whose scale came in a bucket this path did not take: declined (the Dequantizer holds it)
    held = fused.begin(m)
    k = next(i for i, b in enumerate(m.buckets) if b.slots[0].meta.dtype == FP8_DTYPE)
    assert fused.copy(m.buckets[k], bufs[k], _dests(m.buckets[k], params), held) is None
    # after the bucket before it went this way, the scale is held: given to a per-tensor load
    assert fused.copy(m.buckets[k - 1], bufs[k - 1], _dests(m.buckets[k - 1], params), held) is not None
    extra = fused.held_for(m.buckets[k], held)
    assert [n for n, _ in extra] == [m.buckets[k].slots[0].meta.name + "_scale_inv"]
    assert torch.equal(
        extra[0][1].view(torch.uint8).reshape(-1),
        bufs[k - 1][m.buckets[k - 1].slots[-1].offset :][: extra[0][1].numel() * 4],
    )
    plan, buf = m.buckets[0], bufs[0]
    dests = _dests(plan, params)
    i = next(j for j, d in enumerate(dests) if d is not None)
    for bad in (dests[i].t() if dests[i].dim() == 2 else dests[i][::2], torch.zeros(dests[i].shape, dtype=torch.int32)):
        other = list(dests)
        other[i] = bad
        before = {n: p.clone() for n, p in params.items()}
        assert fused.copy(plan, buf, other, fused.begin(m)) is None
        assert all(torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)) for n, p in params.items())
    if use_kernel:  # float16 parameters: the kernel writes bf16 and fp32 only
        p16 = _params(torch.float16)
        fp8_bucket = next(
            b
            for b in m.buckets
            if any(s.meta.dtype == FP8_DTYPE for s in b.slots) and b.slots[0].meta.name.endswith("_scale_inv")
        )
        assert fused.copy(fp8_bucket, bufs[fp8_bucket.index], _dests(fp8_bucket, p16), fused.begin(m)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_finite_e4m3_code_decodes_as_torch_decodes_it(use_kernel, dtype):
    """All 254 finite codes (the two NaN codes the quantizer never writes left out), both signs of
    zero, with scales whose products need rounding to bf16: the kernel's decode and product equal
    torch's float32(q) * s rounded once."""
    from weightsync.bus.plan import make_manifest
    from weightsync.formats.fp8.blocks import dequantize_torch

    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes == 0x7F], codes[codes == 0xFF] = 0x00, 0x80
    q = torch.cat([codes, codes.flip(0)]).reshape(2, 256)
    for s in (0.75, 1.1, 3.0e-5, 2.0**-120):
        scale = torch.full((1, 2), s, dtype=torch.float32)
        metas = [TensorMeta("w_scale_inv", (1, 2), torch.float32), TensorMeta("w", (2, 256), FP8_DTYPE)]
        (plan,) = make_manifest(metas, version=1, sync_id="s", bucket_bytes=1 << 20).buckets
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        buf[plan.slots[0].offset : plan.slots[0].offset + 8] = scale.view(torch.uint8).reshape(-1)
        buf[plan.slots[1].offset : plan.slots[1].offset + 512] = q.reshape(-1)
        out = torch.full((2, 256), float("nan"), dtype=dtype)
        fused = FusedDequant(use_kernel=use_kernel)
        assert fused.copy(
            plan, buf, [None, out], fused.begin(make_manifest(metas, version=1, sync_id="s", bucket_bytes=1 << 20))
        ) == bucket_checksum(buf)
        want = dequantize_torch(q.view(FP8_DTYPE), scale, dtype)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), s
        if use_kernel:  # 256 columns: 16 elements per access
            ((*_, vec),) = [p.tables for p in fused._plans.values()]
            assert vec == 16, vec
