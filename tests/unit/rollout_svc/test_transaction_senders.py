"""The rollout transaction with several senders (trainer ranks streaming their own buckets
concurrently): commit only when every bucket of every sender arrived and verified; a failure on
any sender's stream aborts the whole sync; one stream per sender."""

import threading
import time

import pytest
import torch

from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.sync.transaction import SyncError, SyncTransaction
from tests.support.packed import engine_state, packed_sync
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.errors import TransportError
from weightsync.models import resolve_model
from weightsync.v1 import rollout_pb2

IDS = [3, 1, 4, 1, 5, 9]


def _engine(seed):
    return BuiltinEngine.from_config(resolve_model("tiny-qwen2")[0], seed=seed)


def _sync(src, senders=(0, 5), sync_id="s1", version=1):
    """A manifest whose tensors are dealt round-robin to `senders`, and each bucket's bytes."""
    state = engine_state(src)
    owners = [senders[i % len(senders)] for i in range(len(state))]
    m, bufs = packed_sync(state, version=version, sync_id=sync_id, bucket_bytes=32 << 10, owners=owners)
    return m, {b.index: buf for b, buf in zip(m.buckets, bufs)}


class ListReceiver:
    """One sender's stream: its buckets in order, optionally dying after `die_after` of them."""

    def __init__(self, bufs, die_after=None, delay=0.0):
        self.bufs, self.die_after, self.delay, self.n, self.closed = bufs, die_after, delay, 0, False

    def recv(self, plan, timeout):
        if self.die_after is not None and self.n >= self.die_after:
            raise TransportError("peer closed the connection")
        self.n += 1
        time.sleep(self.delay)
        buf = self.bufs[plan.index]
        return buf, bucket_checksum(buf)

    def close(self):
        self.closed = True


def _logits(tx):
    (_, logits), _ = tx.serve(lambda e: e.score(IDS, 1), timeout=5)
    return logits


def _run_all(tx, m, receivers):
    threads = [threading.Thread(target=tx.run_receiver, args=(m.sync_id, rx, s)) for s, rx in receivers.items()]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("mode", ["staged", "inplace"])
def test_buckets_from_every_sender_commit_exactly(mode):
    target, tx = _engine(1), SyncTransaction(_engine(2), mode)
    m, bufs = _sync(target)
    assert m.senders == [0, 5] and len(m.buckets_of(0)) > 1 and len(m.buckets_of(5)) > 1
    tx.prepare(m, timeout=30)
    threads = _run_all(tx, m, {s: ListReceiver(bufs, delay=0.002) for s in m.senders})
    for t in threads:
        t.join(30)
    version, _, _ = tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in bufs.items()})
    assert version == 1 and tx.state == rollout_pb2.SERVING
    assert torch.equal(_logits(tx), target.score(IDS, 1)[1])


def test_commit_waits_for_every_sender_and_names_the_missing_one():
    tx = SyncTransaction(_engine(2), "staged")
    m, bufs = _sync(_engine(1))
    tx.prepare(m, timeout=1.5)
    for t in _run_all(tx, m, {0: ListReceiver(bufs)}):  # sender 5 never connects
        t.join(30)
    with pytest.raises(SyncError, match=r"missing per sender rank: \{5: \d+\}") as ei:
        tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in bufs.items()})
    assert ei.value.code == "DEADLINE_EXCEEDED"
    assert tx.state == rollout_pb2.SERVING and tx.version == 0


@pytest.mark.parametrize("mode", ["staged", "inplace"])
def test_one_sender_dying_aborts_the_whole_sync(mode):
    tx = SyncTransaction(_engine(2), mode)
    before = _logits(tx)
    m, bufs = _sync(_engine(1))
    tx.prepare(m, timeout=30)
    alive = ListReceiver(bufs, delay=0.01)
    threads = _run_all(tx, m, {0: alive, 5: ListReceiver(bufs, die_after=1)})
    for t in threads:
        t.join(30)
    assert tx.pending_sync_id == "" and alive.closed  # the healthy sender's stream was ended too
    assert alive.n < len(m.buckets_of(0))  # it stopped early
    # the commit is refused, naming why the rollout dropped the sync
    with pytest.raises(SyncError, match="sync s1 was aborted here: .*closed"):
        tx.commit("s1", 1, {})
    if mode == "staged":
        assert tx.state == rollout_pb2.SERVING and tx.version == 0 and torch.equal(_logits(tx), before)
    else:
        assert tx.state == rollout_pb2.STALE


def test_buckets_out_of_their_senders_order_are_refused():
    tx = SyncTransaction(_engine(2), "staged")
    m, bufs = _sync(_engine(1))
    tx.prepare(m, timeout=30)
    first5, second5 = m.buckets_of(5)[:2]
    with pytest.raises(
        SyncError, match=f"bucket {second5.index} arrived from sender 5, expected bucket {first5.index}"
    ):
        tx.consume_bucket("s1", second5.index, bufs[second5.index], None)
    # another sender's first bucket is fine at any time
    tx.consume_bucket("s1", m.buckets_of(0)[0].index, bufs[m.buckets_of(0)[0].index], None)


def test_a_second_stream_for_one_sender_is_refused_without_harming_the_sync():
    tx = SyncTransaction(_engine(2), "staged")
    m, bufs = _sync(_engine(1))
    tx.prepare(m, timeout=30)
    first = ListReceiver(bufs, delay=0.01)
    threads = _run_all(tx, m, {0: first})
    dup = ListReceiver(bufs)
    tx.run_receiver("s1", dup, 0)
    assert dup.closed and dup.n == 0 and tx.pending_sync_id == "s1"
    threads += _run_all(tx, m, {5: ListReceiver(bufs)})
    for t in threads:
        t.join(30)
    assert tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in bufs.items()})[0] == 1


def test_a_sender_with_no_buckets_is_refused():
    tx = SyncTransaction(_engine(2), "staged")
    m, bufs = _sync(_engine(1))
    tx.prepare(m, timeout=30)
    tx.run_receiver("s1", ListReceiver(bufs), 3)
    assert tx.pending_sync_id == "" and "sender 3 streams no bucket" in tx.last_error
