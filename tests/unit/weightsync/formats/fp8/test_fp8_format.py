"""Block FP8 quantization against a reference written from the format's definition.

The reference below uses no torch arithmetic: per 128x128 block it takes amax in float64 (exact
for float32 inputs), the scale as a float32 quotient, each weight's float32 quotient, and rounds
that to e4m3 by hand (round to nearest, ties to even; subnormals in steps of 2**-9; codes built
from sign, exponent and mantissa bits). The module under test must produce the same bytes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from weightsync.formats.fp8 import blocks as fp8

F32 = np.float32


def e4m3_code(y: float) -> int:
    """The e4m3fn byte of a float32 value already clamped to [-448, 448], rounded to nearest even."""
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    if a < 2.0**-6:  # subnormal: m * 2**-9, m in 0..8 (8 is the smallest normal)
        m = round(a * 2**9)  # Python's round is ties-to-even, and a * 2**9 is exact
        return sign | (0x08 if m == 8 else m)
    e = math.frexp(a)[1] - 1  # a = 1.f * 2**e, e in [-6, 8]
    m = round(a / 2.0 ** (e - 3))  # 3 mantissa bits: m in 8..16
    if m == 16:
        e, m = e + 1, 8
    assert -6 <= e <= 8 and 8 <= m < 16, (y, e, m)
    return sign | ((e + 7) << 3) | (m - 8)


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def reference(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(e4m3 codes uint8, float32 scale_inv, float32 dequantized) of a 2-D tensor, block by block."""
    x = w.to(torch.float32).numpy()
    rows, cols = x.shape
    nr, nc = -(-rows // 128), -(-cols // 128)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.zeros((nr, nc), dtype=np.float32)
    deq = np.zeros((rows, cols), dtype=np.float32)
    for i in range(nr):
        for j in range(nc):
            blk = x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = max(abs(float(v)) for v in blk.flat)
            s = F32(F32(amax) / F32(448.0))
            if s < F32(2.0**-126):
                s = F32(1.0)
            scales[i, j] = s
            for (r, c), v in np.ndenumerate(blk):
                y = float(F32(v) / s)
                y = min(max(y, -448.0), 448.0)  # saturate: e4m3fn has no infinities
                code = e4m3_code(y)
                codes[i * 128 + r, j * 128 + c] = code
                deq[i * 128 + r, j * 128 + c] = F32(e4m3_value(code)) * s
    return codes, scales, deq


def _data(shape, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    if kind == "heavy":  # magnitudes over ~14 decades: many weights land on e4m3 subnormals / zero
        w = w * torch.exp(torch.randn(shape, generator=g) * 4)
    elif kind == "zeros":  # whole zero blocks (scale 1), a signed zero, a denormal-only block
        w[: min(shape[0], 128), : min(shape[1], 128)] = 0
        w[0, -1] = -0.0
        if shape[0] > 128:
            w[128:, : min(shape[1], 128)] = 1e-40
    elif kind == "ties":  # exact halfway cases between e4m3 neighbours (ties go to even)
        w = torch.tensor([448.0, 1.0625, 1.1875, -3 * 2.0**-10, 5 * 2.0**-10, 2.0**-10, 0.0])
        w = w.repeat(shape[0], -(-shape[1] // 7))[:, : shape[1]].contiguous()
    return w


SHAPES = [(1, 5), (129, 257), (300, 128), (128, 128), (7, 200)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["randn", "heavy", "zeros", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_and_dequantize_equal_the_reference_bit_for_bit(shape, kind, dtype):
    w = _data(shape, kind, seed=hash((shape, kind)) % 1000).to(dtype)
    q, s = fp8.quantize(w, name="w")
    codes, scales, deq = reference(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == fp8.scale_shape(w.shape) == scales.shape
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), codes)
    np.testing.assert_array_equal(s.numpy().view(np.int32), scales.view(np.int32))
    back = fp8.dequantize(q, s, torch.float32)
    np.testing.assert_array_equal(back.numpy().view(np.int32), deq.view(np.int32))


def test_the_reference_rounds_ties_to_even_and_saturates():
    # hand-checked e4m3 facts, so the reference itself is not taken on trust
    assert e4m3_code(448.0) == 0x7E and e4m3_value(0x7E) == 448.0
    assert e4m3_code(1.0625) == 0x38  # halfway 1 .. 1.125 -> even mantissa (1.0)
    assert e4m3_code(1.1875) == 0x3A  # halfway 1.125 .. 1.25 -> 1.25
    assert e4m3_code(2.0**-10) == 0x00  # half the smallest subnormal -> 0
    assert e4m3_code(3 * 2.0**-10) == 0x02  # 1.5 steps -> 2 steps
    assert e4m3_code(-0.0) == 0x80
    assert e4m3_code(15 * 2.0**-10) == 0x08  # 7.5 steps -> 8 = the smallest normal, 2**-6
    w = torch.tensor([[448.0 * 2, 1.0]])  # amax 896 -> s = 2 -> 896/2 = 448, 1/2 = 0.5
    q, s = fp8.quantize(w)
    assert s.item() == 2.0 and q.float().tolist() == [[448.0, 0.5]]


def test_stacked_matrices_are_quantized_each_on_its_own():
    w = _data((3, 130, 140), "heavy", 5)
    q, s = fp8.quantize(w)
    assert tuple(s.shape) == (3, 2, 2)
    for e in range(3):
        qe, se = fp8.quantize(w[e].contiguous())
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_refused_naming_tensor_and_block(bad):
    w = torch.randn(200, 300)
    w[150, 260] = bad
    with pytest.raises(ValueError, match=r"tensor layers.0.q_proj.weight: block \[1, 2\] holds inf or nan"):
        fp8.quantize(w, name="layers.0.q_proj.weight")


@pytest.mark.parametrize(
    "w,match",
    [
        (torch.zeros(5), "needs a matrix"),
        (torch.zeros(4, 4, dtype=torch.int32), "cannot be quantized"),
        (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "cannot be quantized"),
    ],
)
def test_unquantizable_inputs_are_refused(w, match):
    with pytest.raises(ValueError, match=match):
        fp8.quantize(w)


def test_dequantize_checks_the_scale_shape():
    q, s = fp8.quantize(torch.randn(130, 10))
    with pytest.raises(ValueError, match=r"w_scale_inv: shape \[1, 1\].*expected \[2, 1\]"):
        fp8.dequantize(q, s[:1], name="w")


def test_relative_error_is_bounded_by_e4m3_precision():
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2**-4 of itself
    w = torch.randn(256, 384) * 0.02
    back = fp8.dequantize(*fp8.quantize(w))
    big = w.abs() > w.abs().amax() / 448 * 2**-6 * 4  # well inside the e4m3 normal range of its block
    assert ((back - w).abs()[big] <= w.abs()[big] * 2**-4).all()
