"""delta/codec_triton.py, the fused delta codec, through Triton's interpreter on the CPU
(tests/gpu/test_delta_gpu_codec.py runs it compiled): the payload is byte for byte the torch path's
bitmap (delta.encode(kind=BITMAP)), the apply writes, reports and sums what the torch apply does, and
every payload the torch apply refuses is refused before a byte is written. Skipped where triton is not
installed (the CPU build of torch: CI); there delta/codec.py's torch
path is all there is, and the other delta tests run it."""

from __future__ import annotations

import sys

import pytest
import torch

from weightsync.bus.copy.checksum import word_sums
from weightsync.bus.delta import codec as delta
from weightsync.bus.delta import payload as fmt
from weightsync.bus.errors import TransportError

_WD = {1: torch.uint8, 2: torch.int16}


def _drop_triton() -> None:
    """Forget triton's Python modules (its compiled extension, triton._C, loads once per process)."""
    for name in [
        m for m in sys.modules if (m == "triton" or m.startswith("triton.")) and not m.startswith("triton._C")
    ]:
        del sys.modules[name]


@pytest.fixture
def fused(monkeypatch):
    """codec_triton with its kernels interpreted. Triton decides at decoration whether a function is
    interpreted, its own library's (tl.sum, tl.cumsum) at its import: where triton was imported
    before TRITON_INTERPRET was set (another test), it is imported again, and again after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    again = "triton" in sys.modules
    if again:
        _drop_triton()
    pytest.importorskip("triton")
    from weightsync.bus.delta import codec_triton

    sys.modules.pop("weightsync.bus.delta.kernels_triton", None)  # decorated again, as interpreted functions
    codec_triton._kernels.cache_clear()
    yield codec_triton
    sys.modules.pop("weightsync.bus.delta.kernels_triton", None)
    codec_triton._kernels.cache_clear()
    if again:
        _drop_triton()  # compiled again by whoever imports it next


@pytest.fixture
def small_blocks(fused, monkeypatch):
    """Blocks of 64 words: many blocks, and their edges, in small buckets."""
    monkeypatch.setattr(fused, "BLOCK", 64)
    return fused


def _pair(nbytes: int, word: int, fraction: float = 0.0, seed: int = 0, positions=None):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    new = base.clone()
    w = new.view(_WD[word])
    if positions is None:
        positions = (torch.rand(w.numel(), generator=g) < fraction).nonzero().squeeze(1)
    w[positions] = w[positions] ^ (0x4321 if word == 2 else 0x21)
    return new, base


def _sums(buf: torch.Tensor) -> torch.Tensor:
    return word_sums(buf[: buf.numel() - buf.numel() % 4].view(torch.int32))


def _apply_fused(fused, payload: torch.Tensor, base: torch.Tensor, sums: torch.Tensor | None = None):
    """delta.apply_delta's dispatch on a GPU: a bitmap payload to the kernels, the empty one to torch."""
    kind, word, width, entries = fmt.read_header(payload, base)
    fmt.check_length(payload, kind, word, width, entries, base.numel() // word)
    if kind != delta.BITMAP:
        return delta.apply_delta(payload, base, sums)
    return fused.apply_bitmap(payload, base, word, entries, sums)


def _check_codec(fused, new: torch.Tensor, base: torch.Tensor, word: int) -> torch.Tensor | None:
    """Everything the fused codec gives equals the torch path's; returns the payload."""
    want = delta.encode(new, base, word, kind=delta.BITMAP)  # torch: CPU tensors
    ref = delta.diff(new, base, word)
    d = fused.diff(new, base, word)
    assert d.count() == ref.count()
    assert torch.equal(d.idx, ref.idx) and torch.equal(d.values, ref.values)
    assert torch.equal(_sums(base) + d.sums_change(), _sums(new))  # any size: whole 32-bit words only
    got = fused.encode(new, d)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.dtype == torch.uint8 and torch.equal(got, want)  # byte for byte
    copy = base.clone()
    d.write(copy)
    assert torch.equal(copy, new)
    if got is not None:
        out, ref_out = base.clone(), base.clone()
        applied = _apply_fused(fused, got, out, _sums(base))
        ref_applied = delta.apply_delta(got, ref_out, _sums(base))  # torch: CPU tensors
        assert torch.equal(out, new) and torch.equal(ref_out, new)
        assert torch.equal(applied.positions, ref_applied.positions) and applied.word == word
        assert torch.equal(applied.sums, ref_applied.sums) and torch.equal(applied.sums, _sums(new))
        assert _apply_fused(fused, got, base.clone()).sums is None  # no sums given: none derived
    return got


@pytest.mark.parametrize("word", [1, 2])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.5, 1.0])
def test_payload_is_the_torch_bitmap_byte_for_byte(fused, word, fraction):
    nbytes = 3 * 4096 * 2 + 2 * 7 * word + word  # several blocks and a partial one; an odd count of words
    new, base = _pair(nbytes, word, fraction, seed=int(fraction * 1000) + word)
    got = _check_codec(fused, new, base, word)
    if fraction == 0.0:
        assert got.numel() == delta.HEADER_BYTES  # unchanged: the torch path's empty payload
    elif fraction == 1.0:
        assert got is None  # the bitmap and every word: not smaller than the bucket, goes dense
    else:
        assert got[0] == delta.BITMAP and got[1] == word and got[2] == 0


@pytest.mark.parametrize(
    "nbytes,word",
    [
        (64 * 2 * 5, 2),  # whole blocks only
        (64 * 2 * 5 + 2, 2),  # one word into a sixth block, past the last whole 32-bit word
        (64 * 5 + 3, 1),  # fp8 words: a bitmap byte part-used, 3 tail bytes out of the sums
        (6, 2),  # less than a bitmap byte
    ],
)
def test_block_edges(small_blocks, nbytes, word):
    nwords = nbytes // word
    edges = sorted({0, 1, 7, 8, 63, 64, 65, 127, 128, nwords - 2, nwords - 1} & set(range(nwords)))
    new, base = _pair(nbytes, word, positions=torch.tensor(edges))
    got = _check_codec(small_blocks, new, base, word)
    if got is not None:
        assert got[0] == delta.BITMAP
    for fraction in (0.02, 0.5):  # and random changes across many small blocks
        new, base = _pair(nbytes, word, fraction, seed=nbytes)
        _check_codec(small_blocks, new, base, word)


def test_a_gaps_payload_is_applied_by_torch(fused, monkeypatch):
    new, base = _pair(1 << 15, 2, 0.01, seed=3)
    payload = delta.encode(new, base, 2)  # torch's choice: gaps
    assert payload[0] == delta.GAPS
    monkeypatch.setattr(fused, "apply_bitmap", None)  # not called
    monkeypatch.setattr(delta, "_fused", lambda buf: fused)
    out = base.clone()
    applied = delta.apply_delta(payload, out, _sums(base))
    assert torch.equal(out, new) and torch.equal(applied.sums, _sums(new))


def test_damaged_payloads_are_refused_before_writing(small_blocks, monkeypatch):
    fused = small_blocks
    monkeypatch.setattr(delta, "_fused", lambda buf: fused)  # delta.apply_delta's checks, then the kernels'
    nbytes = 64 * 2 * 3 + 6  # 195 words: the bitmap's last byte holds 3 of them
    new, base = _pair(nbytes, 2, 0.2, seed=5)
    payload = fused.encode(new, fused.diff(new, base, 2))
    assert payload[0] == delta.BITMAP
    out = base.clone()
    with pytest.raises(TransportError, match="shorter than its header"):
        delta.apply_delta(payload[:10], out)
    with pytest.raises(TransportError, match="bytes after its header"):
        delta.apply_delta(payload[:-1], out)
    bad = payload.clone()
    bad[1] = 3  # word size
    with pytest.raises(TransportError, match="does not fit"):
        delta.apply_delta(bad, out)
    last = delta.HEADER_BYTES + (195 + 7) // 8 - 1
    bad = payload.clone()
    bad[last] |= 0x80  # a position past the bucket's end
    with pytest.raises(TransportError, match="past the bucket's end"):
        delta.apply_delta(bad, out)
    bad = payload.clone()
    bad[delta.HEADER_BYTES] ^= 0x01  # one position more or less than the header's entries
    with pytest.raises(TransportError, match="header says"):
        delta.apply_delta(bad, out)
    assert torch.equal(out, base)


def test_delta_dispatches_to_the_fused_codec_on_a_gpu(fused, monkeypatch):
    """delta.diff, encode and apply_delta take the fused path where `_fused` names it (a CUDA buffer with
    Triton; here the CPU under the interpreter): bitmap payloads, exact, the torch Diff's interface."""
    monkeypatch.setattr(delta, "_fused", lambda buf: fused)
    new, base = _pair(1 << 15, 2, 0.02, seed=9)
    d = delta.diff(new, base, 2)
    assert isinstance(d, fused.FusedDiff)
    payload = delta.encode(new, base, 2, d)
    assert payload[0] == delta.BITMAP and torch.equal(payload, delta.encode(new, base, 2))
    out = base.clone()
    applied = delta.apply_delta(payload, out, _sums(base))
    assert torch.equal(out, new) and torch.equal(applied.sums, _sums(new))
    monkeypatch.undo()
    assert torch.equal(payload, delta.encode(new, base, 2, kind=delta.BITMAP))  # the torch path's bytes
    with pytest.raises(ValueError, match="kind"):
        delta.encode(new, base, 2, kind=delta.GAPS)


def test_the_trainers_delta_stream_on_the_fused_path(fused, monkeypatch):
    """publisher/delta_sync.py's DeltaStream on the fused codec, sync after sync: each bucket's checksum (the
    base's sums plus the diff's change) is a full pass's, the kept base is the bucket, the deltas are bitmaps
    that a rollout's copy applies to exactly the bucket with the sums the rollout then checks."""
    from weightsync.bus.copy.checksum import bucket_checksum, from_sums
    from weightsync.bus.layout import ManifestCache
    from weightsync.bus.plan import TensorMeta
    from weightsync.publisher.delta_sync import DeltaBase

    monkeypatch.setattr(delta, "_fused", lambda buf: fused)
    metas = [TensorMeta("w", (300, 256), torch.bfloat16), TensorMeta("s", (4099,), torch.float8_e4m3fn)]  # 1-byte words
    cache, base, g = ManifestCache(), DeltaBase("delta", 1 << 30, "o"), torch.Generator().manual_seed(0)
    buckets, copies = None, None
    for version in (1, 2, 3):
        m = cache.manifest(metas, version=version, sync_id=f"v{version}", bucket_bytes=64 << 10, origin="o")
        if buckets is None:
            buckets = [torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=g) for p in m.buckets]
            copies = [b.clone() for b in buckets]  # the rollout's copy of the base
        else:
            for b in buckets:  # 2 % of the bytes change
                pos = torch.randperm(b.numel(), generator=g)[: b.numel() // 50]
                b[pos] = torch.randint(0, 256, (pos.numel(),), dtype=torch.uint8, generator=g)
        s = base.begin(m, "tcp")
        s.accepted |= {"r"}
        for plan, buf, copy in zip(m.buckets, buckets, copies):
            old_sums = _sums(copy)
            payload, csum, kept = s.encode(plan, buf)
            assert csum == bucket_checksum(buf)
            s.store(plan, buf, kept, csum)
            assert torch.equal(base._bufs[plan.index], buf)
            if version == 1:
                assert payload is None  # no base yet
                continue
            assert isinstance(kept[1], fused.FusedDiff)
            assert payload[0] == delta.BITMAP if kept[1].count() else payload.numel() == delta.HEADER_BYTES
            applied = delta.apply_delta(payload, copy, old_sums)
            assert torch.equal(copy, buf)
            n = copy.numel()
            assert from_sums(applied.sums, copy[n - n % 4 :], n) == csum
        s.finish(True)


def test_torch_runs_where_triton_is_missing_or_the_buffer_is_off_the_gpu(monkeypatch):
    """No triton needed: which codec delta/codec.py picks. The torch path is what every other delta test runs."""
    from types import SimpleNamespace

    from weightsync.bus.delta import codec_triton

    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(codec_triton, "available", lambda: False)  # a CUDA build without triton, or no GPU
    assert delta._fused(gpu) is None
    monkeypatch.setattr(codec_triton, "available", lambda: True)
    assert delta._fused(gpu) is codec_triton
    assert delta._fused(torch.zeros(4, dtype=torch.uint8)) is None  # CPU buffers: torch, triton or not
