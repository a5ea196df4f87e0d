"""The FP8 slot quantizer and the fused FP8 write with the GPU's own conversions (sm_89+, PTX `cvt`) give
the bytes of the bit arithmetic (debug.fp8_gpu_convert=false) and of the CPU torch path, in 16-wide launches
(Triton's own float8 downcast did not, there): every bfloat16 value of [-448, 448] under a scale of
exactly 1 (so every e4m3 tie is met as such), float32 values one ulp either side of every tie,
heavy-tailed weights in many binades, and rows read through Megatron's QKV table.
Run: pytest -m gpu tests/gpu/test_fp8_gpu_conversions.py
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fp8_weights import block_test_weights, bucket_layout
from weightsync import debug

pytestmark = pytest.mark.gpu
needs_sm89 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an sm_89+ GPU"
)


def _every_bf16_in_range() -> torch.Tensor:
    """A (256, 512) bf16 matrix: every finite bfloat16 of magnitude <= 448 (with both zeros), each 128 x 128
    block led by 448 so every block's scale is exactly 1.0 and x / s is x itself; the rest repeats 448."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = bits[bits.isfinite() & (bits.abs() <= 448)]
    out = torch.full((256, 512), 448.0)
    flat = out.view(2, 128, 4, 128).permute(0, 2, 1, 3).reshape(8, 128 * 128)  # row-major blocks
    per = 128 * 128 - 1
    for b in range(8):
        chunk = vals[b * per : (b + 1) * per]
        flat[b, 1 : 1 + chunk.numel()] = chunk
    assert vals.numel() <= 8 * per
    return flat.view(2, 4, 128, 128).permute(0, 2, 1, 3).reshape(256, 512).to(torch.bfloat16)


def _around_every_tie() -> torch.Tensor:
    """A (128, 768) float32 matrix (scale exactly 1.0): every e4m3 value and every midpoint between two
    neighbours, each exactly and one float32 ulp either side, both signs."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    pts = torch.cat([grid, mids])
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(1e9)), torch.nextafter(pts, torch.tensor(-1e9))])
    pts = torch.cat([pts, -pts])
    pts = pts[pts.abs() <= 448]  # above 448 would move the scale off 1.0
    out = torch.full((128 * 768,), 448.0)
    out[1 : 1 + pts.numel()] = pts
    return out.view(128, 768)


def _weights():
    return [
        _every_bf16_in_range(),
        _around_every_tie(),
        block_test_weights((512, 1024), "heavy", 7, torch.bfloat16),
        block_test_weights((384, 256), "heavy", 8, torch.float32),
        block_test_weights((256, 256), "zeros", 9, torch.float32),
    ]


def _quantized(named, gpu: bool, monkeypatch, convert: str) -> torch.Tensor:
    """The bucket bytes of `named` quantized by the slot kernel on the GPU (`gpu`, debug.fp8_gpu_convert
    `convert`) or, as the reference, by the CPU torch path into the same places."""
    from weightsync.formats.fp8 import blocks as fp8
    from weightsync.formats.fp8 import quantize_slots

    shapes = [tuple(w.shape) for w in named]
    places, size = bucket_layout(shapes)
    if not gpu:
        flat = torch.zeros(size, dtype=torch.uint8)
        for w, (s_off, q_off) in zip(named, places):
            qq, ss = fp8.quantize_torch(w.float())
            flat[q_off : q_off + qq.numel()] = qq.reshape(-1).view(torch.uint8)
            flat[s_off : s_off + 4 * ss.numel()] = ss.reshape(-1).view(torch.uint8)
        return flat
    monkeypatch.setattr(debug, "_current", debug.Switches(fp8_gpu_convert=convert != "0"))
    flat = torch.zeros(size, dtype=torch.uint8, device="cuda")
    weights = [
        quantize_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [(si, w.cuda())])
        for i, (si, w, (s_off, q_off)) in enumerate(zip(quantize_slots.stand_ins(shapes), named, places))
    ]
    q = quantize_slots.plan([flat], weights, use_kernel=True)
    assert q is not None and q.use_kernel and all(la.vec == 16 for la in q.launches)  # a launch per source dtype
    q.run()
    assert q.finite()
    return flat.cpu()


@needs_sm89
def test_the_quantizer_with_the_gpus_conversions_writes_the_bytes_of_the_bit_arithmetic(monkeypatch):
    named = _weights()
    places, _ = bucket_layout([tuple(w.shape) for w in named])
    want = _quantized(named, False, monkeypatch, "")
    bad = []
    for name, convert in (("bit arithmetic", "0"), ("GPU conversions", "1")):
        got = _quantized(named, True, monkeypatch, convert)
        for i, (w, (s_off, q_off)) in enumerate(zip(named, places)):
            g, e = got[q_off : q_off + w.numel()], want[q_off : q_off + w.numel()]
            diff = (g != e).nonzero().flatten()
            if diff.numel():
                bad.append(f"{name}, w{i} ({w.dtype}): {diff.numel()} codes differ, first at {diff[:4].tolist()}: "
                           f"{g[diff[:4]].tolist()} against {e[diff[:4]].tolist()}")  # fmt: skip
            if not torch.equal(got[s_off:q_off], want[s_off:q_off]):  # the scales (and zeroed padding)
                bad.append(f"{name}, w{i}: scales differ")
    assert not bad, "\n".join(bad)


@needs_sm89
def test_the_fused_write_with_the_gpus_conversions_stores_the_bit_arithmetics_values(monkeypatch):
    from weightsync.formats.fp8 import quantize_slots, write_slots

    named = [w.cuda() for w in _weights()]
    shapes = [tuple(w.shape) for w in named]
    places, _ = bucket_layout(shapes)
    weights = [
        quantize_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [(si, w)])
        for i, (si, w, (s_off, q_off)) in enumerate(zip(quantize_slots.stand_ins(shapes), named, places))
    ]
    for dtype in (torch.bfloat16, torch.float32):
        got = {}
        for convert in ("0", "1"):
            monkeypatch.setattr(debug, "_current", debug.Switches(fp8_gpu_convert=convert != "0"))
            dests = [torch.full(w.shape, float("nan"), dtype=dtype, device="cuda") for w in named]
            f = write_slots.plan(weights, dests, 1)
            assert f is not None and f.use_kernel and all(la.vec == 16 for la in f.launches)
            sums = f.run()
            assert f.finite()
            got[convert] = (sums.cpu(), [d.cpu() for d in dests])
        assert torch.equal(got["0"][0], got["1"][0]), dtype
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        for i, (a, b) in enumerate(zip(got["0"][1], got["1"][1])):
            diff = (a.view(bits) != b.view(bits)).nonzero()
            assert diff.numel() == 0, f"w{i} {dtype}: {len(diff)} values differ, first at {diff[:4].tolist()}"


@needs_sm89
def test_megatron_qkv_rows_with_the_gpus_conversions(monkeypatch):
    """Rows gathered from a fused QKV parameter through the row table, VEC 16: the bytes of the bit
    arithmetic (test_fp8_slots_gpu holds those to the per-tensor kernel)."""
    from trainer_svc.actor.megatron.rules.transforms import QKV
    from weightsync.formats.fp8 import quantize_slots
    from weightsync.model_spec import Dims

    d = Dims(num_layers=1, hidden_size=3584, num_heads=28, num_query_groups=4, head_dim=128,
             ffn_hidden_size=18944, vocab_size=152064)  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = (torch.randn((28 + 8) * 128, 3584, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    shapes = [tuple(t.shape) for t in QKV.to_hf(qkv, d)]
    places, size = bucket_layout(shapes)
    stands = quantize_slots.stand_ins(shapes)
    pairs = QKV.hf_copies(qkv, stands, d)
    out = {}
    for convert in ("0", "1"):
        monkeypatch.setattr(debug, "_current", debug.Switches(fp8_gpu_convert=convert != "0"))
        flat = torch.zeros(size, dtype=torch.uint8, device="cuda")
        weights = [
            quantize_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [pair])
            for i, (si, pair, (s_off, q_off)) in enumerate(zip(stands, pairs, places))
        ]
        q = quantize_slots.plan([flat], weights)
        assert all(la.vec == 16 for la in q.launches)
        q.run()
        out[convert] = flat.cpu()
    diff = (out["0"] != out["1"]).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"
