"""Colocated RL on SGLang (issue 47 item 3): the rollout releases SGLang's GPU memory for the trainer's step
(rollout_svc/sync/memory_release.py) and the next in-place sync maps it again in the order the GPU's peak
needs: the weights before the first bucket, the KV cache after the last, at commit. Driven through the
sync transaction onto the SGLang adapter over tests/support/fake_sglang.py, which keeps SGLang's scheduler
rules: a tag resumed twice raises, a write into released weights or a request while anything is released fails,
and released weights lose their contents."""

import threading

import pytest
import torch

from rollout_svc.engine.base import SamplingParams
from rollout_svc.sync.transaction import SyncTransaction
from tests.support.fake_sglang import FakeSglang, adapter_on, scripted
from tests.support.packed import packed_sync
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.errors import SyncError
from weightsync.bus.plan import TensorMeta
from weightsync.v1 import rollout_pb2

IDS, LPS = [5, 6, 7], [-0.1, -0.2, -0.3]
RELEASED = "the engine's GPU memory is released for a colocated train step"


pytestmark = pytest.mark.usefixtures("io_struct")  # conftest.py


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # three tensors of 48 KiB in buckets of 64 KiB: three buckets, so an abort can come between two
    return {f"layer.{i}.weight": torch.randn(96, 128, generator=g) for i in range(3)}


def _rollout(colocated: bool = True, apply_mode: str = "inplace", **fake_kw):
    fake = FakeSglang(scripted(IDS, LPS), **fake_kw)
    eng = adapter_on(fake, colocated=colocated)
    eng._metas = {n: TensorMeta(n, tuple(t.shape), t.dtype) for n, t in _state(0).items()}
    return fake, eng, SyncTransaction(eng, apply_mode)


def _sync(tx, state, version: int, upto: int | None = None):
    """Sync `state` as version `version`; with `upto`, only buckets before it arrive and the sync is aborted."""
    m, bufs = packed_sync(state, version=version, sync_id=f"s{version}")
    assert len(bufs) == 3
    sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
    tx.prepare(m, timeout=30)
    for i, buf in enumerate(bufs[:upto]):
        tx.consume_bucket(m.sync_id, i, buf, sums[i])
    if upto is not None:
        tx.abort(m.sync_id, "the trainer gave up")
        return
    tx.commit(m.sync_id, version, sums)


def _generate(tx):
    return tx.serve(lambda eng: eng.generate([[1, 2]], SamplingParams(max_new_tokens=3)), timeout=5)


def test_release_before_training_then_weights_before_the_first_bucket_and_kv_after_the_last():
    fake, eng, tx = _rollout()
    _sync(tx, _state(1), 1)
    fake.events.clear()
    assert tx.release_memory(timeout=5) == ("weights", "kv_cache", "cuda_graph")
    assert fake.events == ["release:weights,kv_cache,cuda_graph"] and tx.memory_released
    assert all(torch.isnan(w).all() for w in fake.weights.values())  # no CPU backup: the contents are gone
    fake.events.clear()
    _sync(tx, _state(2), 2)
    # pause, weights mapped, the three buckets written, then the KV cache (and graphs) mapped, flushed, resumed
    assert fake.events == [
        "pause",
        "resume:weights",
        "update",
        "update",
        "update",
        "resume:kv_cache,cuda_graph",
        "flush",
        "continue",
    ]
    assert not fake.offload_tags and not tx.memory_released and tx.state == rollout_pb2.SERVING
    for name, want in _state(2).items():
        assert torch.equal(fake.weights[name], want)
    results, version = _generate(tx)
    assert version == 2 and results[0].token_ids == IDS


def test_a_request_while_released_is_refused_with_unavailable_and_never_reaches_sglang():
    fake, eng, tx = _rollout()
    _sync(tx, _state(1), 1)
    tx.release_memory(timeout=5)
    calls = len(fake.calls)
    with pytest.raises(SyncError, match=RELEASED) as exc:
        _generate(tx)
    assert exc.value.code == "UNAVAILABLE"
    with pytest.raises(SyncError, match=RELEASED):
        tx.serve(lambda e: e.score([1, 2, 3], 1), timeout=5)
    assert len(fake.calls) == calls


def test_a_sync_aborted_before_its_first_bucket_leaves_the_memory_released_and_requests_refused():
    fake, eng, tx = _rollout()
    _sync(tx, _state(1), 1)
    tx.release_memory(timeout=5)
    fake.events.clear()
    _sync(tx, _state(2), 2, upto=0)
    assert fake.events == [] and fake.offload_tags == {"weights", "kv_cache", "cuda_graph"}
    assert tx.state == rollout_pb2.SERVING and tx.version == 1  # nothing written, but...
    with pytest.raises(SyncError, match=RELEASED):  # ...version 1's weights are gone: not served
        _generate(tx)
    _sync(tx, _state(3), 3)
    assert not fake.offload_tags and _generate(tx)[1] == 3


def test_a_sync_aborted_after_its_first_bucket_is_stale_and_the_next_sync_maps_only_the_kv_cache():
    fake, eng, tx = _rollout()
    _sync(tx, _state(1), 1)
    tx.release_memory(timeout=5)
    fake.events.clear()
    _sync(tx, _state(2), 2, upto=1)
    assert fake.events == ["pause", "resume:weights", "update"]
    assert fake.offload_tags == {"kv_cache", "cuda_graph"} and tx.state == rollout_pb2.STALE
    with pytest.raises(SyncError, match="STALE"):
        _generate(tx)
    fake.events.clear()
    _sync(tx, _state(3), 3)  # the fake raises on a second resume of the weights
    assert fake.events[:2] == ["pause", "update"] and "resume:kv_cache,cuda_graph" in fake.events
    assert not fake.offload_tags and tx.state == rollout_pb2.SERVING
    assert all(torch.equal(fake.weights[n], w) for n, w in _state(3).items())
    assert _generate(tx)[1] == 3


def test_release_is_refused_during_a_sync_without_memory_saver_and_with_the_staged_apply():
    fake, eng, tx = _rollout()
    m, _ = packed_sync(_state(1), version=1, sync_id="s1")
    tx.prepare(m, timeout=30)
    with pytest.raises(SyncError, match="sync s1 is in progress") as exc:
        tx.release_memory(timeout=5)
    assert exc.value.code == "FAILED_PRECONDITION" and fake.events == []
    for kw, why in (
        (dict(colocated=False), "enable_memory_saver=true"),
        (dict(apply_mode="staged"), "--apply-mode inplace"),
    ):
        fake, eng, tx = _rollout(**kw)
        with pytest.raises(SyncError, match=why):
            tx.release_memory(timeout=5)
        assert fake.events == [] and not tx.memory_released


def test_release_waits_for_a_running_request_at_most_its_timeout():
    fake, eng, tx = _rollout(hold_at=1, hold_s=20)
    _sync(tx, _state(1), 1)
    out = {}
    req = threading.Thread(target=lambda: out.setdefault("r", _generate(tx)))
    req.start()
    assert fake.held.wait(10)  # the request is in SGLang, holding its version pin
    with pytest.raises(SyncError, match="requests still ran after 0 s") as exc:
        tx.release_memory(timeout=0.3)
    assert exc.value.code == "UNAVAILABLE" and not tx.memory_released
    assert not [e for e in fake.events if e.startswith("release")]
    fake.release()
    req.join(10)
    assert out["r"][1] == 1
    tx.release_memory(timeout=5)  # idle now
    assert tx.memory_released and fake.offload_tags == {"weights", "kv_cache", "cuda_graph"}
    assert tx.release_memory(timeout=5) == ("weights", "kv_cache", "cuda_graph")  # idempotent: nothing more released
    assert [e for e in fake.events if e.startswith("release")] == ["release:weights,kv_cache,cuda_graph"]


def test_a_failed_release_is_an_internal_error_and_the_rollout_keeps_refusing():
    fake, eng, tx = _rollout()
    _sync(tx, _state(1), 1)
    fake.fail_release = "scheduler not idle"
    with pytest.raises(SyncError, match="memory release failed .*scheduler not idle") as exc:
        tx.release_memory(timeout=5)
    assert exc.value.code == "INTERNAL" and tx.memory_released  # what SGLang freed is unknown: never served
    with pytest.raises(SyncError, match=RELEASED):
        _generate(tx)
    fake.fail_release = ""
    _sync(tx, _state(2), 2)
    assert _generate(tx)[1] == 2
