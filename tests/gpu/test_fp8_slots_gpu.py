"""Block FP8 quantized straight into bucket slots on a GPU (pytest -m gpu tests/gpu/test_fp8_slots_gpu.py).

1. The compiled kernel (weightsync/formats/fp8_slots_triton.py) writes the bytes the CPU torch path
   writes (fp8.quantize), for odd shapes, stacked experts, bf16 and fp32 sources, heavy-tailed,
   zero and denormal blocks and 7B-sized matrices, rows gathered from Megatron's fused QKV and
   gate/up, with one launch per bucket; the flag catches an inf or nan block.
2. Its time for one Qwen2-7B layer against the per-tensor path (quantize + pack copy), printed.
The whole sync is measured by bench/bench_services.py (docs/BENCHMARKS.md, "FP8 export").
"""

from __future__ import annotations

import math
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(1, 5), (129, 257), (300, 128), (7, 200), (1000, 3), (3, 130, 140), (3584, 3584), (512, 3584), (18944, 3584)]


def _data(shape, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    if kind == "heavy":
        w = w * torch.exp(torch.randn(shape, generator=g) * 4)
    elif kind == "zeros":
        w[..., :128, :128] = 0
        if shape[-2] > 128:
            w[..., 128:256, :128] = 1e-40
    return w


def _layout(shapes, start: int = 0):
    """(scale offset, weight offset) per shape, 256-aligned as bucket plans are, and the bucket size."""
    from weightsync.formats import fp8

    places, pos = [], start
    for shape in shapes:
        s_off = -(-pos // 256) * 256
        q_off = -(-(s_off + 4 * math.prod(fp8.scale_shape(shape))) // 256) * 256
        places.append((s_off, q_off))
        pos = q_off + math.prod(shape)
    return places, pos + 3


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["randn", "heavy", "zeros"])
def test_the_compiled_kernel_writes_the_bytes_of_the_cpu_path(kind, dtype):
    from weightsync.formats import fp8, fp8_slots

    named = [_data(s, kind, 10 + i).to(dtype) for i, s in enumerate(SHAPES)]
    places, size = _layout(SHAPES, start=40)
    flat = torch.full((size,), 0xAB, dtype=torch.uint8, device="cuda")
    want = flat.cpu().clone()
    srcs = [w.cuda() for w in named]
    weights = [
        fp8_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [(si, src)])
        for i, (si, src, (s_off, q_off)) in enumerate(zip(fp8_slots.stand_ins(SHAPES), srcs, places))
    ]
    q = fp8_slots.plan([flat], weights)
    assert q is not None and q.use_kernel and len(q.launches) == 1
    q.run()
    assert q.finite()
    for w, (s_off, q_off) in zip(named, places):
        qq, ss = fp8.quantize(w)
        want[q_off : q_off + qq.numel()] = qq.reshape(-1).view(torch.uint8)
        want[s_off : s_off + 4 * ss.numel()] = ss.reshape(-1).view(torch.uint8)
    assert torch.equal(flat.cpu(), want)
    srcs[1][100, 200] = float("nan")
    q.run()
    assert not q.finite() and "tensor w1: block [0, 1]" in str(q.first_non_finite())


@needs_cuda
def test_megatron_qkv_and_gate_up_rows_on_the_gpu():
    from trainer_svc.actor.megatron.rules.transforms import GATE_UP, QKV
    from weightsync.formats import fp8, fp8_slots
    from weightsync.model_spec import Dims

    d = Dims(
        num_layers=1,
        hidden_size=3584,
        num_heads=28,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=18944,
        vocab_size=152064,
    )
    qkv = (torch.randn((28 + 8) * 128, 3584, device="cuda") * 0.02).to(torch.bfloat16)
    fc1 = (torch.randn(2 * 18944, 3584, device="cuda") * 0.02).to(torch.bfloat16)
    hf = [*QKV.to_hf(qkv, d), *GATE_UP.to_hf(fc1, d)]
    shapes = [tuple(t.shape) for t in hf]
    places, size = _layout(shapes)
    flat = torch.zeros(size, dtype=torch.uint8, device="cuda")
    stands = fp8_slots.stand_ins(shapes)
    pairs = QKV.hf_copies(qkv, stands[:3], d) + GATE_UP.hf_copies(fc1, stands[3:], d)
    weights = [
        fp8_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [pair])
        for i, (si, pair, (s_off, q_off)) in enumerate(zip(stands, pairs, places))
    ]
    q = fp8_slots.plan([flat], weights)
    q.run()
    for t, (s_off, q_off) in zip(hf, places):
        qq, ss = fp8.quantize(t.contiguous())  # the per-tensor Triton kernel, held to the CPU path by test_fp8_gpu
        assert torch.equal(flat[q_off : q_off + qq.numel()], qq.reshape(-1).view(torch.uint8))
        assert torch.equal(flat[s_off : s_off + 4 * ss.numel()], ss.reshape(-1).view(torch.uint8))


@needs_cuda
def test_one_7b_layer_into_its_bucket_against_quantize_and_pack():
    from weightsync.formats import fp8, fp8_slots

    shapes = [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944)]
    ws = [(torch.randn(s, device="cuda") * 0.02).to(torch.bfloat16) for s in shapes]
    places, size = _layout(shapes)
    flat = torch.zeros(size, dtype=torch.uint8, device="cuda")
    weights = [
        fp8_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [(si, w)])
        for i, (si, w, (s_off, q_off)) in enumerate(zip(fp8_slots.stand_ins(shapes), ws, places))
    ]
    q = fp8_slots.plan([flat], weights)

    def per_tensor():
        for w, (s_off, q_off) in zip(ws, places):  # today's path: float32 export, quantize, pack
            qq, ss = fp8.quantize(w.float(), check_finite=False)
            flat[q_off : q_off + qq.numel()].copy_(qq.reshape(-1).view(torch.uint8))
            flat[s_off : s_off + 4 * ss.numel()].copy_(ss.reshape(-1).view(torch.uint8))

    def timed(fn, reps=10) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    old = timed(per_tensor)
    want = flat.clone()
    flat.zero_()
    new = timed(q.run)
    assert torch.equal(flat, want)
    nbytes = sum(w.numel() * 3 for w in ws)  # read 2 bytes, write 1 per weight
    print(
        f"one Qwen2-7B layer (bf16 params) to FP8 slots: per tensor {old * 1e3:.2f} ms, one launch "
        f"{new * 1e3:.2f} ms ({nbytes / new / 1e9:.0f} GB/s)"
    )
    assert new < 0.5
