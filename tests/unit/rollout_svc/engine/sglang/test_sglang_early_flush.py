"""SGLang's radix cache is flushed while a sync's buckets arrive, not after the last one (sglang_engine.py
`begin_apply` / `end_apply`): the flush (a scheduler round trip, 1.2-2 ms on an H200) was the gap between a
sync into SGLang and one into the built-in engine. Paused, SGLang schedules no forward, so the cache stays
empty until continue; the commit still waits for the flush and fails with its error. With SGLang's memory
released the flush stays after the KV cache is mapped again (test_sglang_colocated.py checks that order)."""

import threading
from types import SimpleNamespace

import pytest
import torch

from rollout_svc.sync.transaction import SyncTransaction
from tests.support.fake_sglang import FakeSglang, adapter_on, scripted
from tests.support.packed import packed_sync
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.plan import TensorMeta
from weightsync.v1 import rollout_pb2

pytestmark = pytest.mark.usefixtures("io_struct")  # conftest.py


class HeldFlush(FakeSglang):
    """flush_cache says when it started and answers only once the test lets it (or with `fail`)."""

    def __init__(self, *a, fail: bool = False, **kw):
        super().__init__(*a, **kw)
        self.started, self.go, self.fail = threading.Event(), threading.Event(), fail

    def flush_cache(self):
        self.started.set()
        assert self.go.wait(30), "the test never let the flush answer"
        self.events.append("flush")
        # SGLang's Engine.flush_cache answers a FlushCacheReqOutput: not a success while requests run
        return SimpleNamespace(success=not self.fail, message="requests are running" if self.fail else "")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(96, 128, generator=g) for i in range(3)}  # three 64 KiB buckets


def _rollout(fake):
    eng = adapter_on(fake)
    eng._metas = {n: TensorMeta(n, tuple(t.shape), t.dtype) for n, t in _state(0).items()}
    return SyncTransaction(eng, "inplace")


def _prepare_and_send(tx, fake, version: int):
    m, bufs = packed_sync(_state(version), version=version, sync_id=f"s{version}")
    sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
    tx.prepare(m, timeout=30)
    tx.consume_bucket(m.sync_id, 0, bufs[0], sums[0])
    # the flush went out with the pause (the first bucket's, here): it overlaps the rest of the stream
    assert fake.started.wait(10), "no flush_cache call after the pause"
    for i, buf in enumerate(bufs[1:], 1):
        tx.consume_bucket(m.sync_id, i, buf, sums[i])
    assert fake.events == ["pause", "update", "update", "update"]  # the flush is still held
    return m, sums


def test_the_flush_overlaps_the_stream_and_the_commit_waits_for_it():
    fake = HeldFlush(scripted([5], [-0.1]))
    tx = _rollout(fake)
    m, sums = _prepare_and_send(tx, fake, 1)
    done = threading.Event()
    committer = threading.Thread(target=lambda: (tx.commit(m.sync_id, 1, sums), done.set()), daemon=True)
    committer.start()
    assert not done.wait(0.3), "the commit returned while SGLang's flush had not answered"
    assert "continue" not in fake.events  # SGLang is not resumed before its cache is flushed
    fake.go.set()
    committer.join(30)
    assert done.is_set() and fake.events == ["pause", "update", "update", "update", "flush", "continue"]
    assert tx.state == rollout_pb2.SERVING and tx.version == 1
    for name, want in _state(1).items():
        assert torch.equal(fake.weights[name], want)


def test_a_failed_flush_fails_the_commit():
    fake = HeldFlush(scripted([5], [-0.1]), fail=True)
    tx = _rollout(fake)
    m, sums = _prepare_and_send(tx, fake, 1)
    fake.go.set()
    with pytest.raises(Exception, match="flush_cache failed: requests are running"):
        tx.commit(m.sync_id, 1, sums)
    assert tx.version != 1
