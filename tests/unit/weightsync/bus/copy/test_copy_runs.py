"""copy/copy_runs.py: the contiguous runs of a (destination, source) view pair cover it exactly, and the
batched copy writes what `copy_` writes (torch on the CPU; the Triton kernel through Triton's
interpreter where triton is installed, bit for bit, casts and unaligned slots included)."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.actor.megatron.rules.transforms import GATE_UP, QKV, SWAP_HALVES
from weightsync.bus.copy import copy_runs_triton
from weightsync.bus.copy.copy_runs import MAX_RUNS_PER_PAIR, BatchedCopy, contiguous_runs
from weightsync.model_spec import Dims

D = Dims(num_layers=1, hidden_size=64, num_heads=8, num_query_groups=2, head_dim=8, ffn_hidden_size=12, vocab_size=90)
QKV_ROWS = 2 * (4 + 2) * 8  # groups * (heads per group + k + v) * head_dim


def _slots(want: list[torch.Tensor], dtype: torch.dtype, start: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat buffer (poisoned) holding a slot per tensor of `want`, the first at element `start`."""
    flat = torch.full((start + sum(w.numel() for w in want) + 5,), float("nan"), dtype=dtype)
    outs, pos = [], start
    for w in want:
        outs.append(flat[pos : pos + w.numel()].view(w.shape))
        pos += w.numel()
    return flat, outs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _cases(sdt: torch.dtype):
    g = torch.Generator().manual_seed(3)
    qkv_w = (torch.randn(QKV_ROWS, 64, generator=g) * 50).to(sdt)
    qkv_b = (torch.randn(QKV_ROWS, generator=g) * 50).to(sdt)
    fc1 = torch.randn(24, 64, generator=g).to(sdt)
    emb = torch.randn(96, 64, generator=g).to(sdt)  # a padded vocabulary: rows past 90 are dropped
    return [
        ("qkv weight", qkv_w, lambda outs: QKV.hf_copies(qkv_w, outs, D), QKV.to_hf(qkv_w, D)),
        ("qkv bias", qkv_b, lambda outs: QKV.hf_copies(qkv_b, outs, D), QKV.to_hf(qkv_b, D)),
        ("gate/up", fc1, lambda outs: GATE_UP.hf_copies(fc1, outs, D), GATE_UP.to_hf(fc1, D)),
        ("vocab trim", emb, lambda outs: [(outs[0], emb.narrow(0, 0, 90))], [emb[:90]]),
        ("swap halves", fc1, lambda outs: SWAP_HALVES.hf_copies(fc1, outs, D), SWAP_HALVES.to_hf(fc1, D)),
    ]


@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("sdt", [torch.bfloat16, torch.float32])
def test_runs_cover_every_pair_exactly(sdt, start):
    """Applied as flat copies between the two storages, the runs write exactly what copy_ writes."""
    for what, src, pairs_of, want in _cases(sdt):
        flat, outs = _slots(want, sdt, start)
        base_src, base_dst = src.data_ptr(), flat.data_ptr()
        flat_src, es = src.reshape(-1), src.element_size()
        for dst, s in pairs_of(outs):
            runs = contiguous_runs(dst, s)
            assert runs is not None, what
            for sa, da, n in runs:
                i, j = (sa - base_src) // es, (da - base_dst) // es
                flat[j : j + n] = flat_src[i : i + n]
        for o, w in zip(outs, want, strict=True):
            assert torch.equal(_bits(o), _bits(w)), what
        assert flat[:start].isnan().all() and flat[start + sum(w.numel() for w in want) :].isnan().all(), what


def test_pairs_that_are_not_runs_are_said_so():
    t = torch.randn(8, 6)
    assert contiguous_runs(torch.empty(6, 8), t.t()) is None  # element-wise strided: no contiguous inner dim
    tall = torch.randn(MAX_RUNS_PER_PAIR + 1, 4)
    assert contiguous_runs(torch.empty(MAX_RUNS_PER_PAIR + 1, 2), tall[:, :2]) is None  # too many runs
    assert len(contiguous_runs(torch.empty(MAX_RUNS_PER_PAIR, 2), tall[:MAX_RUNS_PER_PAIR, :2])) == MAX_RUNS_PER_PAIR
    assert contiguous_runs(torch.empty(0, 4), tall[:0]) == []
    with pytest.raises(ValueError, match="shape"):
        contiguous_runs(torch.empty(3), torch.empty(4))


def test_off_the_gpu_every_pair_is_torchs_and_exact():
    for what, _src, pairs_of, want in _cases(torch.float32):
        _, outs = _slots(want, torch.bfloat16, 1)
        bc = BatchedCopy(pairs_of(outs))
        assert bc.launches == [] and bc.torch_pairs == bc.pairs > 0, what
        bc.run()
        for o, w in zip(outs, want, strict=True):
            assert torch.equal(_bits(o), _bits(w.to(torch.bfloat16))), what


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    copy_runs_triton._kernel.cache_clear()  # decorated again, as an interpreted function
    yield
    copy_runs_triton._kernel.cache_clear()


@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("sdt,ddt", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_the_kernel_writes_the_bits_torch_writes(interpreted, sdt, ddt, start):
    """Through Triton's interpreter on the CPU; tests/gpu/test_copy_runs_gpu.py runs it compiled."""
    cases = _cases(sdt)
    pairs, expect = [], []
    for _, _, pairs_of, want in cases:
        _, outs = _slots(want, ddt, start)
        pairs += pairs_of(outs)
        expect += list(zip(outs, [w.to(ddt) for w in want]))
    # ties to even, a value that rounds up into the next binade, the largest finite values, subnormals
    if sdt == torch.float32:
        special = torch.tensor([1.00390625, 1.01171875, 3.3961e38, -3.0e38, 1e-40, float("inf"), 2**-133])
        src = torch.cat([special, torch.randn(93)])
        dst = torch.zeros(101, dtype=ddt)[1:]
        pairs.append((dst, src))
        expect.append((dst, src.to(ddt)))
    bc = BatchedCopy(pairs, use_kernel=True)
    assert bc.torch_pairs == 0 and bc.launches
    # slots at an odd element and the special values' (odd) slot take the unaligned launch
    aligned = {copy_runs_triton.ALIGN} if start == 0 else set()
    assert {align for *_, align in bc.launches} == aligned | ({1} if start or sdt == torch.float32 else set())
    bc.run()
    for got, want in expect:
        assert torch.equal(_bits(got), _bits(want))


def test_the_interpreted_cast_writes_every_nan_as_cudas_canonical_nan(interpreted):
    """A diverged float32 norm (NaN of any sign and payload) becomes 0x7FFF, what torch's copy_
    writes on a GPU (cvt.rn.bf16.f32); tests/gpu/test_copy_runs_gpu.py holds the compiled kernel
    to torch's own CUDA copy of the same words."""
    words = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0x3F800000], dtype=torch.int64)
    src = words.to(torch.int32).view(torch.float32)  # the int64 -> int32 cast wraps: the exact words
    dst = torch.zeros(6, dtype=torch.bfloat16)
    BatchedCopy([(dst, src)], use_kernel=True).run()
    assert dst.view(torch.int16).tolist()[:5] == [0x7FFF] * 5
    assert dst[5].item() == 1.0
