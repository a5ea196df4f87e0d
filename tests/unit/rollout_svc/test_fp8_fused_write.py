"""Block-FP8 buckets written into the built-in engine by one fused write per bucket
(rollout_svc/sync/fp8_fused_write.py)
through the real transaction: the per-weight dequantize is not called at all, the engine ends with the
per-tensor path's exact weights, and the apply modes keep their contracts: staged writes nothing
into a served parameter before every bucket's checksum is verified (also when the check was deferred
to commit); inplace writes as buckets arrive and turns STALE on a later bad bucket. A bucket the
engine cannot take goes the per-tensor way with the scale the fused write held for it."""

from __future__ import annotations

import pytest
import torch

from rollout_svc.sync.transaction import SyncError, SyncTransaction
from tests.unit.rollout_svc.test_fp8_sync import _engine, _fp8_sync
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.formats.fp8 import blocks as fp8
from weightsync.formats.fp8 import dequantize_slots, receive
from weightsync.formats.fp8.export import is_quantized
from weightsync.v1 import rollout_pb2


@pytest.fixture
def fused_calls(monkeypatch):
    """(bucket index, written or declined) of every fused write; the per-weight dequantize refuses to run."""
    calls = []
    plain = dequantize_slots.FusedDequant.copy

    def copy(self, plan, *a, **k):
        out = plain(self, plan, *a, **k)
        calls.append((plan.index, out is not None))
        return out

    monkeypatch.setattr(dequantize_slots.FusedDequant, "copy", copy)
    return calls


def _no_per_weight_dequantize(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a weight went through the per-tensor dequantize")

    monkeypatch.setattr(receive, "dequantize", refuse)


def _weights(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.named_weights()}


def _expected(src) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in src.named_weights():
        want = fp8.dequantize(*fp8.quantize(p)) if is_quantized(n, tuple(p.shape)) else p
        out[n] = want.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("mode", ["staged", "inplace"])
@pytest.mark.parametrize("defer", [False, True])
def test_every_bucket_goes_in_one_fused_write(monkeypatch, fused_calls, mode, defer):
    src, eng = _engine("tiny-qwen2", 1), _engine("tiny-qwen2", 2, dtype=torch.bfloat16)
    m, bufs = _fp8_sync(src)
    _no_per_weight_dequantize(monkeypatch)
    tx = SyncTransaction(eng, mode)
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket(m.sync_id, b.index, buf, bucket_checksum(buf), defer_check=defer)
    tx.commit(m.sync_id, m.version, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    assert tx.state == rollout_pb2.SERVING and tx.version == 1
    assert sorted(fused_calls) == [(b.index, True) for b in m.buckets]
    got, want = _weights(eng), _expected(src)
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("defer", [False, True])
def test_staged_writes_nothing_before_every_checksum_is_verified(fused_calls, defer):
    """A bucket corrupted in transit: with the check at receipt or deferred to commit, the commit
    fails, no fused write ran, and the engine serves its old weights byte for byte."""
    src, eng = _engine("tiny-qwen2", 1), _engine("tiny-qwen2", 2, dtype=torch.bfloat16)
    m, bufs = _fp8_sync(src)
    sums = [bucket_checksum(b) for b in bufs]
    last = len(bufs) - 1
    bufs[last][7] ^= 0x10  # the last bucket: every other one was already staged when it arrives
    before = _weights(eng)
    tx = SyncTransaction(eng, "staged")
    tx.prepare(m, timeout=30)
    with pytest.raises(SyncError, match="checksum"):
        for b, buf in zip(m.buckets, bufs):
            tx.consume_bucket(m.sync_id, b.index, buf, sums[b.index], defer_check=defer)
        tx.commit(m.sync_id, m.version, dict(enumerate(sums)))
    tx.abort(m.sync_id, "bad bucket")  # what the receiver does after a bad bucket (a no-op once aborted)
    assert fused_calls == []
    assert tx.state == rollout_pb2.SERVING and tx.version == 0
    after = _weights(eng)
    assert all(torch.equal(after[n].view(torch.int16), before[n].view(torch.int16)) for n in before)


def test_inplace_writes_as_buckets_arrive_and_a_bad_later_bucket_leaves_it_stale(fused_calls):
    src, eng = _engine("tiny-qwen2", 1), _engine("tiny-qwen2", 2, dtype=torch.bfloat16)
    m, bufs = _fp8_sync(src)
    sums = [bucket_checksum(b) for b in bufs]
    bufs[2][7] ^= 0x10
    tx = SyncTransaction(eng, "inplace")
    tx.prepare(m, timeout=30)
    tx.consume_bucket(m.sync_id, 0, bufs[0], sums[0])
    tx.consume_bucket(m.sync_id, 1, bufs[1], sums[1])
    assert fused_calls == [(0, True), (1, True)]  # written at receipt
    with pytest.raises(SyncError, match="checksum"):
        tx.consume_bucket(m.sync_id, 2, bufs[2], sums[2])  # written, then found corrupted
    assert fused_calls[-1] == (2, True)
    tx.abort(m.sync_id, "bad bucket")
    assert tx.state == rollout_pb2.STALE


@pytest.mark.parametrize("mode", ["staged", "inplace"])
def test_a_bucket_the_engine_cannot_take_loads_per_tensor_with_the_held_scale(monkeypatch, fused_calls, mode):
    src, eng = _engine("tiny-qwen2", 1), _engine("tiny-qwen2", 2, dtype=torch.bfloat16)
    m, bufs = _fp8_sync(src)
    # a bucket that opens with a weight whose scale ended the bucket before (held by the fused write)
    k = next(b.index for b in m.buckets if b.index and b.slots[0].meta.dtype == fp8.FP8_DTYPE)
    refused = {s.meta.name for s in m.buckets[k].slots}
    offer = eng.writable_params
    monkeypatch.setattr(
        eng, "writable_params", lambda metas: None if any(x.name in refused for x in metas) else offer(metas)
    )
    tx = SyncTransaction(eng, mode)
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket(m.sync_id, b.index, buf, bucket_checksum(buf))
    tx.commit(m.sync_id, m.version, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    assert tx.state == rollout_pb2.SERVING and tx.version == 1
    assert k not in {i for i, ok in fused_calls if ok} and (k - 1, True) in fused_calls
    got, want = _weights(eng), _expected(src)
    assert all(torch.equal(got[n], want[n]) for n in want)
