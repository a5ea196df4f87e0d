"""The fused delta codec (weightsync/bus/delta/codec_triton.py) compiled on a GPU: the payload byte for byte the torch
path's bitmap (delta.encode(kind=BITMAP), computed on the CPU), the apply exact with the torch apply's positions
and sums, damaged payloads refused before a byte is written; and its rate on a 1 GiB bucket, printed (-s).
tests/unit/weightsync/bus/delta/test_delta_codec_triton.py runs the same kernels through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from bench.common.timing import cuda_median_s

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pair(nbytes: int, word: int, fraction: float, seed: int, positions=None):
    dev = torch.device("cuda:0")
    g = torch.Generator(device=dev).manual_seed(seed)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=g)
    new = base.clone()
    w = new.view(torch.int16 if word == 2 else torch.uint8)
    if positions is None:
        positions = (torch.rand(w.numel(), device=dev, generator=g) < fraction).nonzero().squeeze(1)
    w[positions.to(dev)] ^= 0x4321 if word == 2 else 0x21
    return new, base


def _sums(buf):
    from weightsync.bus.copy.checksum import word_sums

    return word_sums(buf[: buf.numel() - buf.numel() % 4].view(torch.int32))


def _cases():
    for word in (1, 2):
        for fraction in (0.0, 0.001, 0.02, 0.5, 1.0):
            yield word, fraction, (16 << 20) + 6 * word  # a partial block, a tail past the last whole 32-bit word
    yield 2, None, None  # block edges: a block's first and last words, the bucket's last


@needs_cuda
@pytest.mark.parametrize("word,fraction,nbytes", list(_cases()))
def test_fused_codec_is_the_torch_bitmap_and_exact(word, fraction, nbytes):
    from weightsync.bus.delta import codec as delta
    from weightsync.bus.delta import codec_triton

    assert codec_triton.available(), "triton is missing: the GPU runs the torch codec"
    edges = None
    if fraction is None:
        b = codec_triton.BLOCK
        nbytes = b * word * 3 + word
        edges = torch.tensor([0, 1, b - 1, b, 2 * b - 1, 2 * b, nbytes // word - 1])
    new, base = _pair(nbytes, word, fraction or 0.0, seed=int((fraction or 0) * 1000) + word, positions=edges)
    d = delta.diff(new, base, word)
    assert isinstance(d, codec_triton.FusedDiff)
    payload = delta.encode(new, base, word, d)
    want = delta.encode(new.cpu(), base.cpu(), word, kind=delta.BITMAP)  # the torch path, on the CPU
    assert (payload is None) == (want is None)
    if payload is not None:
        assert payload.is_cuda and torch.equal(payload.cpu(), want)
    wd = torch.int16 if word == 2 else torch.uint8
    assert d.count() == int((new.view(wd) != base.view(wd)).sum())
    assert torch.equal(_sums(base) + d.sums_change(), _sums(new))  # the trainer's incremental checksum
    copy = base.clone()
    d.write(copy)
    assert torch.equal(copy, new)
    if payload is None:
        return
    out, ref = base.clone(), base.cpu()
    applied = delta.apply_delta(payload, out, _sums(base))
    ref_applied = delta.apply_delta(payload.cpu(), ref, _sums(base.cpu()))
    assert torch.equal(out, new)
    assert torch.equal(applied.positions.cpu(), ref_applied.positions)
    assert torch.equal(applied.sums.cpu(), ref_applied.sums) and torch.equal(applied.sums, _sums(new))


@needs_cuda
def test_damaged_payloads_are_refused_before_writing():
    from weightsync.bus.delta import codec as delta
    from weightsync.bus.errors import TransportError

    nbytes = (1 << 20) + 6  # 524291 words: the bitmap's last byte holds 3 of them
    new, base = _pair(nbytes, 2, 0.2, seed=5)
    payload = delta.encode(new, base, 2)
    assert payload[0] == delta.BITMAP
    out = base.clone()
    with pytest.raises(TransportError, match="bytes after its header"):
        delta.apply_delta(payload[:-1], out)
    bad = payload.clone()
    bad[16 + (nbytes // 2 + 7) // 8 - 1] |= 0x80
    with pytest.raises(TransportError, match="past the bucket's end"):
        delta.apply_delta(bad, out)
    bad = payload.clone()
    bad[16] ^= 0x01
    with pytest.raises(TransportError, match="header says"):
        delta.apply_delta(bad, out)
    assert torch.equal(out, base)


def _rate(fn, nbytes: int, reps: int = 5) -> float:
    return nbytes / 1e9 / cuda_median_s(fn, reps)


@needs_cuda
def test_fused_codec_rate_is_printed(capsys):
    """Not a threshold (bench/bench_delta_gpu_codec.py measures): a 1 GiB bucket at 2 % runs and is exact."""
    from weightsync.bus.delta import codec as delta

    nbytes = 1 << 30
    new, base = _pair(nbytes, 2, 0.02, seed=7)
    sums = _sums(base)
    payload = delta.encode(new, base, 2)
    copy = base.clone()
    assert torch.equal(delta.apply_delta(payload, copy, sums).sums, _sums(new)) and torch.equal(copy, new)
    enc = _rate(lambda: delta.encode(new, base, 2, delta.diff(new, base, 2)), nbytes)
    app = _rate(lambda: delta.apply_delta(payload, copy, sums), nbytes)  # onto the patched copy: the same work
    with capsys.disabled():
        print(
            f"\nfused delta codec, 1 GiB bf16 bucket, 2 % changed, {torch.cuda.get_device_name(0)}: "
            f"compare+encode {enc:.0f} GB/s, apply with sums {app:.0f} GB/s, payload {payload.numel() / nbytes:.3f}x"
        )
