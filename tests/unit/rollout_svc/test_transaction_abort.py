"""Aborts racing the receiver: a bucket of an aborted inplace sync is never loaded, the engine lock is freed."""

import pytest
import torch

from rollout_svc.engine.builtin import BuiltinEngine  # noqa: F401  (the real engine)
from rollout_svc.sync.transaction import SyncTransaction
from weightsync.bus.errors import SyncError
from weightsync.bus.pack import alloc_buffer, pack_bucket
from weightsync.bus.plan import make_manifest
from weightsync.v1 import rollout_pb2


def _engine():
    from rollout_svc.config import RolloutConfig
    from rollout_svc.engine.factory import make_engine

    return make_engine(RolloutConfig.from_flat(model="tiny-qwen2"))


@pytest.mark.parametrize("mode", ["staged", "inplace"])
def test_bucket_after_abort_is_refused_and_lock_free(mode):
    eng = _engine()
    tx = SyncTransaction(eng, mode)
    before = {n: p.clone() for n, p in eng._params.items()}
    man = make_manifest(list(eng.param_metas().values()), version=3, sync_id="s1", bucket_bytes=1 << 14)
    tx.prepare(man, timeout=30)
    tx.abort("s1", "test abort")
    plan = man.buckets[0]
    buf = alloc_buffer(plan.nbytes, "cpu")
    pack_bucket(plan, [(s.meta.name, torch.ones(s.meta.shape)) for s in plan.slots], buf)
    with pytest.raises(SyncError):
        tx.consume_bucket("s1", 0, buf, None)
    assert tx.state == rollout_pb2.SERVING and tx.version == 0
    assert all(torch.equal(before[n], p) for n, p in eng._params.items())
    assert tx.engine_lock.acquire(timeout=1)
    tx.engine_lock.release()


def test_abort_while_inplace_receiver_waits_for_the_engine_lock():
    """A Generate holds the engine lock; the receiver waits for it; an abort lands meanwhile. The engine
    must not end with the lock held forever or with SERVING on partly loaded weights."""
    import threading
    import time

    eng = _engine()
    tx = SyncTransaction(eng, "inplace")
    before = {n: p.clone() for n, p in eng._params.items()}
    man = make_manifest(list(eng.param_metas().values()), version=3, sync_id="s1", bucket_bytes=1 << 14)
    tx.prepare(man, timeout=30)
    plan = man.buckets[0]
    buf = alloc_buffer(plan.nbytes, "cpu")
    pack_bucket(plan, [(s.meta.name, torch.ones(s.meta.shape)) for s in plan.slots], buf)
    tx.engine_lock.acquire()  # a generation in progress
    errors = []
    t = threading.Thread(target=lambda: _catch(errors, tx.consume_bucket, "s1", 0, buf, None))
    t.start()
    time.sleep(0.2)
    aborter = threading.Thread(target=tx.abort, args=("s1", "trainer gone"))
    aborter.start()
    time.sleep(0.2)
    tx.engine_lock.release()  # generation finishes
    t.join(10)
    aborter.join(10)
    assert not t.is_alive() and not aborter.is_alive()
    assert tx.engine_lock.acquire(timeout=2), "engine lock leaked: generation would hang"
    tx.engine_lock.release()
    changed = any(not torch.equal(before[n], p) for n, p in eng._params.items())
    assert tx.state == (rollout_pb2.STALE if changed else rollout_pb2.SERVING), (tx.state, changed, errors)
    assert tx.pending_sync_id == ""


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except SyncError as exc:
        errors.append(exc)
