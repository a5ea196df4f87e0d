"""The rollout's transaction when the trainer writes the buckets into the engine itself (CUDA IPC,
weightsync/bus/ipc/trainer_writes.py), against the real built-in engine on a CPU: generation paused from
the prepare, the commit's checksums recorded as the version's, an abort leaving the engine STALE, and no
bucket accepted from anywhere else."""

import pytest
import torch

from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.sync.transaction import SyncTransaction
from tests.support.packed import engine_state, packed_sync
from weightsync.bus.copy.checksum import bucket_checksum, combine
from weightsync.bus.errors import SyncError
from weightsync.models import resolve_model
from weightsync.v1 import rollout_pb2

IDS = [3, 1, 4, 1, 5, 9]


def _engine(seed):
    return BuiltinEngine.from_config(resolve_model("tiny-qwen2")[0], seed=seed)


def _manifest_and_buckets(src, sync_id="s1"):
    state = engine_state(src)
    return (*packed_sync(state, sync_id=sync_id), state)


def _write_like_the_trainer(tx, state):
    """What the trainer's kernel does through the mapped parameters: their bytes, in place."""
    with torch.no_grad():
        for name, t in state.items():
            tx.engine._target(name).copy_(t)


def test_the_engine_is_paused_from_prepare_and_the_commit_records_the_trainers_checksums():
    tx = SyncTransaction(_engine(2), "inplace")
    m, bufs, state = _manifest_and_buckets(_engine(1))
    tx.prepare(m, timeout=30)
    tx.accept_trainer_writes("s1")
    assert tx.engine_lock.locked() and tx.state == rollout_pb2.APPLYING
    _write_like_the_trainer(tx, state)
    sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
    version, weights, _ = tx.commit("s1", 1, sums)
    assert version == 1 and weights == combine([sums[i] for i in range(len(bufs))])
    assert tx.state == rollout_pb2.SERVING and not tx.engine_lock.locked()
    want = _engine(1)
    (_, logits), v = tx.serve(lambda e: e.score(IDS, 1), timeout=5)
    assert v == 1 and torch.equal(logits, want.score(IDS, 1)[1])


def test_a_commit_without_every_checksum_is_refused_and_leaves_the_engine_stale():
    tx = SyncTransaction(_engine(2), "inplace")
    m, bufs, state = _manifest_and_buckets(_engine(1))
    tx.prepare(m, timeout=30)
    tx.accept_trainer_writes("s1")
    with pytest.raises(SyncError, match=f"commit carries 1 checksums for {len(bufs)} buckets"):
        tx.commit("s1", 1, {0: bucket_checksum(bufs[0])})
    assert tx.state == rollout_pb2.STALE and not tx.engine_lock.locked()


def test_an_abort_after_the_prepare_leaves_the_engine_stale_until_a_complete_sync():
    tx = SyncTransaction(_engine(2), "inplace")
    m, bufs, state = _manifest_and_buckets(_engine(1))
    tx.prepare(m, timeout=30)
    tx.accept_trainer_writes("s1")
    tx.abort("s1", "the trainer's write failed")
    # the trainer may have written any part: nothing is served until a complete sync commits
    assert tx.state == rollout_pb2.STALE and not tx.engine_lock.locked()
    with pytest.raises(SyncError, match="STALE"):
        tx.serve(lambda e: e.score(IDS, 1), timeout=5)
    m2, bufs2, state2 = _manifest_and_buckets(_engine(1), sync_id="s2")
    tx.prepare(m2, timeout=30)
    tx.accept_trainer_writes("s2")
    _write_like_the_trainer(tx, state2)
    tx.commit("s2", 1, {i: bucket_checksum(b) for i, b in enumerate(bufs2)})
    assert tx.state == rollout_pb2.SERVING


def test_no_bucket_is_accepted_for_a_sync_the_trainer_writes():
    tx = SyncTransaction(_engine(2), "inplace")
    m, bufs, _ = _manifest_and_buckets(_engine(1))
    tx.prepare(m, timeout=30)
    tx.accept_trainer_writes("s1")
    with pytest.raises(SyncError, match="the trainer writes sync s1 into the engine itself"):
        tx.consume_bucket("s1", 0, bufs[0], bucket_checksum(bufs[0]))


def test_a_staged_rollout_refuses_to_be_written_into_and_aborts_the_sync():
    tx = SyncTransaction(_engine(2), "staged")
    m, _, _ = _manifest_and_buckets(_engine(1))
    tx.prepare(m, timeout=30)
    with pytest.raises(SyncError, match="apply_mode=staged: the trainer writes into the engine only in inplace"):
        tx.accept_trainer_writes("s1")
    assert tx.pending_sync_id == "" and tx.state == rollout_pb2.SERVING and tx.version == 0


def test_generation_that_holds_the_engine_past_the_deadline_fails_the_prepare_without_staleness():
    import threading
    import time

    tx = SyncTransaction(_engine(2), "inplace")
    release = threading.Event()
    busy = threading.Thread(target=lambda: tx.serve(lambda e: release.wait(15), timeout=5), daemon=True)
    busy.start()
    deadline = time.monotonic() + 5
    while not tx.engine_lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    m, _, _ = _manifest_and_buckets(_engine(1))
    tx.prepare(m, timeout=0.3)
    try:
        with pytest.raises(SyncError, match="could not pause generation before the sync deadline"):
            tx.accept_trainer_writes("s1")
        # nothing was handed to the trainer: the old version serves on
        assert tx.pending_sync_id == "" and tx.state == rollout_pb2.SERVING
    finally:
        release.set()
        busy.join(5)
