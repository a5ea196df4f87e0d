"""Block FP8 quantized straight into bucket slots on a GPU (pytest -m gpu tests/gpu/test_fp8_slots_gpu.py).

1. The compiled kernel (weightsync/formats/fp8/quantize_slots_triton.py) writes the bytes the CPU torch path
   writes (fp8.quantize), for odd shapes, stacked experts, bf16 and fp32 sources, heavy-tailed,
   zero and denormal blocks and 7B-sized matrices, rows gathered from Megatron's fused QKV and
   gate/up, with one launch per bucket; the flag catches an inf or nan block.
2. Its time for one Qwen2-7B layer against the per-tensor path (quantize + pack copy), printed.
The whole sync is measured by `python -m bench services` (docs/BENCHMARKS.md; the first runs:
docs/benchmarks-history.md, "FP8 export").
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.fp8_weights import block_test_weights, bucket_layout

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(1, 5), (129, 257), (300, 128), (7, 200), (1000, 3), (3, 130, 140), (3584, 3584), (512, 3584), (18944, 3584)]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["randn", "heavy", "zeros"])
def test_the_compiled_kernel_writes_the_bytes_of_the_cpu_path(kind, dtype):
    from weightsync.formats.fp8 import blocks as fp8
    from weightsync.formats.fp8 import quantize_slots

    named = [block_test_weights(s, kind, 10 + i, dtype) for i, s in enumerate(SHAPES)]
    places, size = bucket_layout(SHAPES, start=40)
    flat = torch.full((size,), 0xAB, dtype=torch.uint8, device="cuda")
    want = flat.cpu().clone()
    srcs = [w.cuda() for w in named]
    weights = [
        quantize_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [(si, src)])
        for i, (si, src, (s_off, q_off)) in enumerate(zip(quantize_slots.stand_ins(SHAPES), srcs, places))
    ]
    q = quantize_slots.plan([flat], weights)
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
    from weightsync.formats.fp8 import blocks as fp8
    from weightsync.formats.fp8 import quantize_slots
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
    places, size = bucket_layout(shapes)
    flat = torch.zeros(size, dtype=torch.uint8, device="cuda")
    stands = quantize_slots.stand_ins(shapes)
    pairs = QKV.hf_copies(qkv, stands[:3], d) + GATE_UP.hf_copies(fc1, stands[3:], d)
    weights = [
        quantize_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [pair])
        for i, (si, pair, (s_off, q_off)) in enumerate(zip(stands, pairs, places))
    ]
    q = quantize_slots.plan([flat], weights)
    q.run()
    for t, (s_off, q_off) in zip(hf, places):
        qq, ss = fp8.quantize(t.contiguous())  # the per-tensor Triton kernel, held to the CPU path by test_fp8_gpu
        assert torch.equal(flat[q_off : q_off + qq.numel()], qq.reshape(-1).view(torch.uint8))
        assert torch.equal(flat[s_off : s_off + 4 * ss.numel()], ss.reshape(-1).view(torch.uint8))


@needs_cuda
def test_one_7b_layer_into_its_bucket_against_quantize_and_pack():
    from weightsync.formats.fp8 import blocks as fp8
    from weightsync.formats.fp8 import quantize_slots

    shapes = [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944)]
    ws = [(torch.randn(s, device="cuda") * 0.02).to(torch.bfloat16) for s in shapes]
    places, size = bucket_layout(shapes)
    flat = torch.zeros(size, dtype=torch.uint8, device="cuda")
    weights = [
        quantize_slots.SlotWeight(f"w{i}", 0, q_off, s_off, si, [(si, w)])
        for i, (si, w, (s_off, q_off)) in enumerate(zip(quantize_slots.stand_ins(shapes), ws, places))
    ]
    q = quantize_slots.plan([flat], weights)

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


@needs_cuda
def test_a_bucket_dequantized_into_parameters_in_one_launch_equals_the_per_tensor_path():
    """The rollout's side (weightsync/formats/fp8/dequantize_slots.py): one Qwen2-7B layer's bucket, with a
    bf16 norm and bias, into bf16 parameters: the parameters the Dequantizer + copy give, the
    bucket_checksum, and both times printed."""
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.layout import ManifestCache
    from weightsync.bus.pack import pack_bucket, unpack_bucket
    from weightsync.bus.plan import TensorMeta
    from weightsync.formats.fp8.dequantize_slots import FusedDequant
    from weightsync.formats.fp8.export import export_metas, export_tensors
    from weightsync.formats.fp8.receive import Dequantizer
    from weightsync.formats.fp8.spec import BLOCK_FP8

    layer = "model.layers.0."
    shapes = {
        layer + "input_layernorm.weight": (3584,),
        layer + "self_attn.q_proj.weight": (3584, 3584),
        layer + "self_attn.q_proj.bias": (3584,),
        layer + "self_attn.k_proj.weight": (512, 3584),
        layer + "self_attn.v_proj.weight": (512, 3584),
        layer + "self_attn.o_proj.weight": (3584, 3584),
        layer + "mlp.gate_proj.weight": (18944, 3584),
        layer + "mlp.up_proj.weight": (18944, 3584),
        layer + "mlp.down_proj.weight": (3584, 18944),
    }
    named = [(n, torch.randn(s, device="cuda") * 0.02) for n, s in shapes.items()]
    m = ManifestCache().manifest(
        export_metas([TensorMeta(n, s, torch.float32) for n, s in shapes.items()]),
        version=1,
        sync_id="s",
        bucket_bytes=1 << 30,
        quantization=BLOCK_FP8,
    )
    (plan,) = m.buckets
    buf = torch.zeros(plan.nbytes, dtype=torch.uint8, device="cuda")
    pack_bucket(plan, export_tensors(named), buf)
    params = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()}
    dests = [None if s.meta.name.endswith("_scale_inv") else params[s.meta.name] for s in plan.slots]
    fused = FusedDequant()

    def one_launch():
        return fused.copy(plan, buf, dests, fused.begin(m), wait=False)

    def per_tensor():
        bucket_checksum(buf)
        for n, t in Dequantizer({n: torch.bfloat16 for n in shapes})(unpack_bucket(plan, buf)):
            params[n].copy_(t)

    def timed(fn, reps=10) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    old = timed(per_tensor)
    want = {n: p.clone() for n, p in params.items()}
    for p in params.values():
        p.fill_(float("nan"))
    new = timed(one_launch)
    assert all(torch.equal(params[n].view(torch.int16), want[n].view(torch.int16)) for n in shapes)
    assert one_launch().value() == bucket_checksum(buf)
    print(
        f"one Qwen2-7B layer's FP8 bucket into bf16 parameters: checksum + per tensor {old * 1e3:.2f} ms, "
        f"one launch {new * 1e3:.2f} ms"
    )


@needs_cuda
def test_bench_fp8_slots_on_a_1_5b_model(tmp_path):
    """bench/bench_fp8_slots.py on a Qwen2-1.5B-shaped megatron model: the compiled kernels' bytes equal
    the torch paths' (quantize and dequantize), every step timed and printed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "quantize_slots.json"
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "bench_fp8_slots.py"), "--shape", "1.5b", "--reps", "3"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rec = json.loads(out.read_text())
    assert rec["kernels"] == "triton" and rec["quant_matches_torch"] and rec["dequant_matches_torch"], rec
