"""The delta's one comparison pass (delta.diff): the same positions, payload, checksum sums and base update as a
word-by-word reference, for every block width the buffers' alignment allows; the CPU checksum equals torch's sums."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.copy import checksum
from weightsync.bus.delta.codec import apply_delta, diff, encode


def _pair(nbytes: int, fraction: float, word: int, offset: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=g)[offset:]
    new = base.clone() if offset == 0 else torch.cat([torch.zeros(offset, dtype=torch.uint8), base])[offset:]
    changed = (torch.rand(nbytes // word, generator=g) < fraction).nonzero().squeeze(1)
    w = new.view(torch.int16) if word == 2 and offset % 2 == 0 else None
    if w is not None:
        w[changed] = w[changed] ^ 0x0101
    else:
        for b in range(word):
            new[changed * word + b] ^= 0x10
    return new, base


@pytest.mark.parametrize("word", [1, 2])
@pytest.mark.parametrize("offset", [0, 2, 4])  # 64-bit, 16-bit and 32-bit blocks
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.3])
def test_diff_matches_a_word_by_word_comparison(word, offset, fraction):
    new, base = _pair((1 << 16) + 8, fraction, word, offset, seed=int(fraction * 1000) + offset + word)
    wd = torch.int16 if word == 2 else torch.uint8
    d = diff(new, base, word)
    want = (new.view(wd) != base.view(wd)).nonzero().squeeze(1)
    assert torch.equal(d.idx, want) and torch.equal(d.values, new.view(wd)[want])
    if new.storage_offset() % 4 == 0:
        whole = lambda b: checksum.word_sums(b.view(torch.int32))  # noqa: E731
        assert torch.equal(whole(base) + d.sums_change(), whole(new))
    payload = encode(new, base, word, d)
    assert payload is None or torch.equal(payload, encode(new, base, word, want))  # positions only: same bytes
    out = base.clone()
    d.write(out)
    assert torch.equal(out, new)
    if payload is not None:
        out = base.clone()
        apply_delta(payload, out)
        assert torch.equal(out, new)


def test_cpu_word_sums_equal_torchs_wrapping_sums():
    g = torch.Generator().manual_seed(1)
    for n in (0, 1, 1000, (1 << 16) + 3, 3 << 17):
        w = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
        w[: min(n, 4)] = torch.tensor([-(2**31), 2**31 - 1, -1, 46341], dtype=torch.int32)[: min(n, 4)]
        ref = torch.stack([w.sum(dtype=torch.int64), (w * w).sum(dtype=torch.int64)])
        assert torch.equal(checksum.word_sums(w), ref)
        dst = torch.empty_like(w)
        assert torch.equal(checksum.copy_word_sums(w, dst), ref) and torch.equal(dst, w)


@pytest.mark.parametrize("fraction", [0.0005, 0.02, 0.3])  # fillers across steps, plain gaps, bitmap
def test_a_bucket_compared_and_applied_in_steps_gives_the_same_payload_and_result(monkeypatch, fraction):
    from weightsync.bus.delta import codec as delta

    new, base = _pair(1 << 16, fraction, 2, 0, seed=7)
    whole = encode(new, base, 2)
    monkeypatch.setattr(delta, "_STEP_BYTES", 1 << 10)  # 64 steps of the compare
    monkeypatch.setattr(delta, "_STEP_ENTRIES", 64)  # and of the apply
    d = diff(new, base, 2)
    assert len(d.parts) == 64
    payload = encode(new, base, 2, d)
    assert torch.equal(payload, whole)
    out = base.clone()
    apply_delta(payload, out)
    assert torch.equal(out, new)
    ref = checksum.word_sums(base.view(torch.int32)) + d.sums_change()
    assert torch.equal(ref, checksum.word_sums(new.view(torch.int32)))
