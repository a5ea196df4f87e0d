"""An engine whose own copy is the checksum pass (`load_bucket_summed` / `queue_bucket_summed`: SGLang's TP
workers, rollout_svc/engine/sglang_direct.py) inside the in-place sync transaction: checked after the write,
buckets the sender holds until commit written together when the commit reads their checksums."""

import pytest
import torch

from rollout_svc.sync.transaction import SyncTransaction
from tests.unit.rollout_svc.test_transaction import IDS, HookedEngine, _buckets, _engine, _logits
from weightsync.bus.copy.checksum import bucket_checksum, word_sums
from weightsync.bus.copy.verified_copy import PendingChecksum
from weightsync.bus.errors import SyncError
from weightsync.bus.pack import unpack_bucket
from weightsync.v1 import rollout_pb2


class _Queued(PendingChecksum):
    def __init__(self, owner):
        super().__init__(torch.zeros(2, dtype=torch.int64), torch.empty(0, dtype=torch.uint8), 0)
        self.owner, self.checksum = owner, None

    def wait(self):
        if self.checksum is None:
            self.owner.flush()

    def value(self):
        self.wait()
        return self.checksum


class SummedEngine(HookedEngine):
    """Loads a bucket and returns the checksum of the bytes it read; queued buckets are loaded by one flush."""

    def load_bucket_summed(self, plan, buf):
        self.calls.append(("summed", plan.index))
        self.load_weights(unpack_bucket(plan, buf))
        return bucket_checksum(buf[: plan.nbytes])

    def queue_bucket_summed(self, plan, buf):
        self.calls.append(("queued", plan.index))
        q = _Queued(self)
        self.queue.append((plan, buf, q))
        return q

    def flush(self):
        items, self.queue = self.queue, []
        self.calls.append(("flush", [plan.index for plan, _, _ in items]))
        for plan, buf, q in items:
            self.load_weights(unpack_bucket(plan, buf))
            # what the commit reads (pending_values): the word sums of what was read, the last bytes, the size
            whole = plan.nbytes - plan.nbytes % 4
            q.sums, q.tail, q.nbytes = word_sums(buf[:whole].view(torch.int32)), buf[whole : plan.nbytes], plan.nbytes
            q.checksum = bucket_checksum(buf[: plan.nbytes])


def _summed_engine(seed):
    eng = _engine(seed, SummedEngine)
    eng.calls, eng.queue = [], []
    return eng


@pytest.mark.parametrize("held", [False, True])
def test_the_engines_summed_load_is_the_check_and_held_buckets_are_written_together_at_commit(held):
    eng, target = _summed_engine(2), _engine(1)
    tx = SyncTransaction(eng, "inplace")
    m, bufs = _buckets(target)
    sums = [bucket_checksum(b) for b in bufs]
    assert len(bufs) >= 3
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, sums[b.index] if b.index == 0 else None, defer_check=held)
    rest = list(range(1, len(bufs)))
    # the first bucket is checked before the engine is touched, then loaded on its own, or, held, queued with the
    # rest: one engine call for the sync
    if held:
        assert eng.calls == ["begin"] + [("queued", i) for i in [0, *rest]]
    else:
        assert eng.calls == ["begin", ("bucket", 0)] + [("summed", i) for i in rest]
    tx.commit("s1", 1, dict(enumerate(sums)))
    assert eng.calls[-2:] == ([("flush", [0, *rest]), "end"] if held else [("summed", rest[-1]), "end"])
    assert torch.equal(_logits(tx), target.score(IDS, 1)[1])


@pytest.mark.parametrize("held", [False, True])
def test_a_corrupted_bucket_the_engine_read_aborts_the_sync_and_leaves_it_stale(held):
    eng = _summed_engine(2)
    tx = SyncTransaction(eng, "inplace")
    m, bufs = _buckets(_engine(1))
    sums = [bucket_checksum(b) for b in bufs]
    bufs[1][5] ^= 0x01
    tx.prepare(m, timeout=30)
    with pytest.raises(SyncError, match=r"bucket 1: checksum 0x[0-9a-f]+ != sender.s") as err:
        for b, buf in zip(m.buckets, bufs):
            tx.consume_bucket("s1", b.index, buf, sums[b.index], defer_check=held)
        tx.commit("s1", 1, dict(enumerate(sums)))
    assert err.value.code == "DATA_LOSS"
    if not held:  # raised at receipt: the receiver aborts the sync (as run_receiver does)
        tx.abort("s1", "checksum")
    assert tx.state == rollout_pb2.STALE and tx.version == 0


def test_a_corrupted_first_bucket_is_refused_before_the_engine_is_touched_even_when_held():
    """The first bucket's early check stays when it is queued with the rest: a bad one leaves the old version
    serving (the engine never paused, nothing queued)."""
    eng = _summed_engine(2)
    tx = SyncTransaction(eng, "inplace")
    m, bufs = _buckets(_engine(1))
    sums = [bucket_checksum(b) for b in bufs]
    bufs[0][3] ^= 0x01
    tx.prepare(m, timeout=30)
    with pytest.raises(SyncError, match=r"bucket 0: checksum 0x[0-9a-f]+ != sender.s"):
        tx.consume_bucket("s1", 0, bufs[0], sums[0], defer_check=True)
    tx.abort("s1", "checksum")
    assert eng.calls == [] and tx.state == rollout_pb2.SERVING and tx.version == 0


def test_a_held_first_bucket_the_engine_read_wrongly_aborts_at_commit_stale():
    """Queued, the first bucket is checked twice: before the engine is touched (the buffer), and at commit (what the
    engine's copy read)."""
    eng = _summed_engine(2)
    tx = SyncTransaction(eng, "inplace")
    m, bufs = _buckets(_engine(1))
    sums = [bucket_checksum(b) for b in bufs]
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, sums[b.index], defer_check=True)
    bufs[0][3] ^= 0x01  # changed after the early check, before the engine's queued copy reads it
    with pytest.raises(SyncError, match=r"bucket 0: checksum 0x[0-9a-f]+ != sender.s"):
        tx.commit("s1", 1, dict(enumerate(sums)))
    assert tx.state == rollout_pb2.STALE and tx.version == 0
