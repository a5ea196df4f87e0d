"""The delta codec: changed words as a bitmap or gaps (with fillers), applied back bit-exact; bad payloads refused."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.delta.codec import BITMAP, GAPS, apply_delta, encode, word_bytes
from weightsync.bus.errors import TransportError
from weightsync.bus.plan import TensorMeta, plan_buckets


def _pair(nbytes: int, fraction: float, word: int, seed: int = 0, positions=None):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    new = base.clone()
    w = new.view(torch.int16) if word == 2 else new
    if positions is None:
        positions = (torch.rand(w.numel(), generator=g) < fraction).nonzero().squeeze(1)
    w[positions] = w[positions] ^ 0x21
    return new, base


@pytest.mark.parametrize(
    "nbytes,fraction,word,kind,gap",
    [
        (1 << 20, 0.02, 2, GAPS, 1),  # mean gap 50: one-byte gaps, rare fillers
        (1 << 20, 0.0001, 2, GAPS, 2),  # mean gap 10k: two-byte gaps
        (1 << 20, 0.30, 2, BITMAP, None),  # dense changes: one bit per word is cheaper
        (1 << 16, 0.02, 1, GAPS, 1),  # fp8: one-byte words
    ],
)
def test_round_trip_is_bit_exact_and_picks_the_smaller_encoding(nbytes, fraction, word, kind, gap):
    new, base = _pair(nbytes, fraction, word)
    payload = encode(new, base, word)
    assert payload is not None and payload.numel() < nbytes
    assert payload[0] == kind and payload[1] == word and (gap is None or payload[2] == gap)
    out = base.clone()
    apply_delta(payload, out)
    assert torch.equal(out, new)


def test_gaps_wider_than_their_width_are_bridged_by_fillers():
    changed = torch.cat([torch.arange(0, 200, 2), torch.tensor([600])])  # 100 small gaps, one of 402
    new, base = _pair(1 << 16, 0, 2, positions=changed)
    payload = encode(new, base, 2)
    assert payload[0] == GAPS and payload[2] == 1  # 1-byte gaps plus a filler beat 2-byte gaps here
    assert int.from_bytes(bytes(payload[8:16].numpy()), "little") == 102  # 101 changes + 1 filler
    out = base.clone()
    apply_delta(payload, out)
    assert torch.equal(out, new)


def test_unchanged_bucket_is_a_header_and_a_changed_one_goes_dense():
    new, base = _pair(4096, 0, 2)
    payload = encode(new, base, 2)
    assert payload.numel() == 16
    out = base.clone()
    apply_delta(payload, out)
    assert torch.equal(out, new)
    new, base = _pair(4096, 1.0, 2)
    assert encode(new, base, 2) is None


def test_damaged_payloads_are_refused_before_writing():
    new, base = _pair(1 << 16, 0.02, 2)
    payload = encode(new, base, 2)
    out = base.clone()
    with pytest.raises(TransportError, match="bytes after its header"):
        apply_delta(payload[:-1], out)
    bad = payload.clone()
    bad[1] = 3  # word size
    with pytest.raises(TransportError, match="does not fit"):
        apply_delta(bad, out)
    bad = payload.clone()
    bad[16:18] = 255  # a jump past the end of the bucket... or a zero gap
    bad[16] = 0
    with pytest.raises(TransportError, match="outside the bucket"):
        apply_delta(bad, out)
    assert torch.equal(out, base)


def test_word_is_one_byte_for_fp8_buckets():
    metas = [TensorMeta("a", (4, 4), torch.bfloat16), TensorMeta("b", (16,), torch.float8_e4m3fn)]
    plans = plan_buckets(metas, 1 << 20)
    assert word_bytes(plans[0]) == 1
    plans = plan_buckets(metas[:1], 1 << 20)
    assert word_bytes(plans[0]) == 2


@pytest.mark.parametrize(
    "nbytes,fraction,word,step",
    [
        (1 << 20, 0.02, 2, 0),  # gaps
        (1 << 20, 0.30, 2, 0),  # bitmap
        ((1 << 16) + 3, 0.02, 1, 0),  # fp8 words, and a tail past the last whole 32-bit word
        (1 << 20, 0.02, 2, 1001),  # steps of 1001 gaps: a 32-bit word's two halves written in two steps
        (1 << 20, 0.30, 2, 1001),  # bitmap steps of 1001 bytes
    ],
)
def test_apply_gives_the_written_positions_and_the_results_word_sums(nbytes, fraction, word, step, monkeypatch):
    from weightsync.bus.copy.checksum import bucket_checksum, from_sums, word_sums
    from weightsync.bus.delta import codec as delta

    if step:
        monkeypatch.setattr(delta, "_STEP_ENTRIES", step)

    new, base = _pair(nbytes, fraction, word)
    whole = nbytes - nbytes % 4
    payload = encode(new, base, word)
    out = base.clone()
    applied = apply_delta(payload, out, word_sums(base[:whole].view(torch.int32)))
    assert torch.equal(out, new)
    assert torch.equal(applied.sums, word_sums(new[:whole].view(torch.int32)))
    assert from_sums(applied.sums, new[whole:], nbytes) == bucket_checksum(new)
    w = lambda b: b.view(torch.int16) if word == 2 else b  # noqa: E731
    changed = (w(new) != w(base)).nonzero().squeeze(1)
    assert set(changed.tolist()) <= set(applied.positions.tolist())  # fillers rewrite unchanged words
    assert torch.all(applied.positions[1:] > applied.positions[:-1])
    # a wrong base gives other sums: the result's checksum then differs from the sender's
    wrong = base.clone()
    wrong[5] ^= 1
    bad = apply_delta(payload, wrong.clone(), word_sums(wrong[:whole].view(torch.int32)))
    assert from_sums(bad.sums, new[whole:], nbytes) != bucket_checksum(new)
    assert apply_delta(payload, base.clone()).sums is None  # no sums given: none derived
