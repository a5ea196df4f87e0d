"""Issue 49: a target silent mid-stream is taken out of any stream, not only the single TCP sender's.

- NCCL (a collective cannot lose one rank): the session's MemberCut aborts the whole stream once it is
  armed, and the attempt restarts the live members (restart_live): they get AbortSync, become the
  retry's targets and are not counted as failed; the cut member is failed with why it was cut.
- Multi-sender TCP: rank 0 raises a drop flag on the trainer job's store (StoreFlags.drop_target, here
  on a real TCPStore as torchrun's), and every sending rank's DropFollower drops the target from its
  own connections: two sender ranks (threads) stream to a healthy rollout and one whose bus link is
  stalled by the test proxy (a hung host); the senders are held after their first tensors until both
  followers have read the drop, so it lands mid-stream by construction. The healthy rollout commits
  exactly; the dropped one is named by both ranks.
The whole NCCL path through processes: tests/e2e/test_nccl_straggler.py.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist
from test_attempt import _attempt, _Orch, _Session
from test_multisender import IDS, TOKEN, RankActor, _run, _setup

from tests.support.bus_proxy import BusProxy
from weightsync.bus.channel import BucketSender
from weightsync.bus.nccl.cut import MemberCut
from weightsync.bus.nccl.liveness import LocalFlags, StoreFlags
from weightsync.publisher.drop_follow import DropFollower
from weightsync.publisher.multisender import SendJob, merge
from weightsync.publisher.stream_cut import owners_drop, restart_live, stream_drop


def test_a_member_cut_ends_the_armed_stream_and_only_for_members_keeping_the_first_reason():
    cut, aborted = MemberCut(["r0", "r1", "r2"]), []
    assert not cut.cut("r2", "silent")  # no stream yet: the deadline bounds it
    cut.arm(aborted.append)
    assert not cut.cut("r9", "silent")  # not a member of this group
    assert cut.cut("r2", "went silent mid-stream (1.00s)") and cut.cut("r2", "again")
    assert cut.why == {"r2": "went silent mid-stream (1.00s)"}
    assert aborted == [
        "member r2 cut out of the group: went silent mid-stream (1.00s)",
        "member r2 cut out of the group: again",
    ]


def test_the_stream_drop_is_the_channels_own_or_a_collectives_cut_or_none():
    class Dropping(BucketSender):
        def drop(self, tid, why):
            return True

    tcp, nccl, dropping = _Session(), _Session(group_wide=True), Dropping()
    assert stream_drop(tcp, dropping) == dropping.drop
    assert stream_drop(tcp, BucketSender()) is None  # cannot drop one target: no watch, the deadline bounds it
    assert stream_drop(nccl, BucketSender()) == nccl.cut
    flags = LocalFlags()
    drop = owners_drop(tcp, flags, "s1")
    assert drop("r1", "silent") and flags.dropped("s1") == {"r1": "silent"} and flags.dropped("s2") == {}
    assert owners_drop(tcp, None, "s1") is None and owners_drop(nccl, flags, "s1") == nccl.cut


class _CutSession(_Session):
    name = "nccl"

    def __init__(self):
        super().__init__(group_wide=True)
        self.cuts = MemberCut(["a", "b", "c"])

    def cut_reasons(self) -> dict[str, str]:  # as the NCCL session declares them (weightsync/bus/nccl/sender.py)
        return self.cuts.why


def test_after_a_cut_the_live_members_are_aborted_and_restarted_and_only_the_cut_one_fails():
    orch, session = _Orch(), _CutSession()
    attempt, *_ = _attempt(orch, session, rids=("a", "b", "c"))
    session.cuts.arm(lambda reason: None)
    session.cuts.cut("c", "stream: UNAVAILABLE: the rollout went silent mid-stream")
    failed = {rid: "nccl stream: NCCL broadcast failed: member c cut out" for rid in ("a", "b", "c")}
    left = restart_live(attempt, session, failed)
    assert left == {"c": "stream: UNAVAILABLE: the rollout went silent mid-stream"}
    assert sorted(e.rollout_id for e in attempt.retry) == ["a", "b"]
    assert sorted(orch.calls) == [("a", "AbortSync"), ("b", "AbortSync")]  # never the silent one
    assert attempt.aborted == {"a", "b"} and orch.failed == []  # superseded by the restart, not failed
    assert all("restarted without c" in attempt.results[r].error for r in ("a", "b"))
    # nothing was cut (a stream that failed on its own): every failure is reported as before
    orch2, session2 = _Orch(), _CutSession()
    attempt2, *_ = _attempt(orch2, session2, rids=("a", "b", "c"))
    assert restart_live(attempt2, session2, dict(failed)) == failed and attempt2.retry == []


def test_drops_raised_by_rank_0_are_read_by_another_rank_in_order_without_a_key_per_sync():
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    rank0, rank1 = StoreFlags(master), StoreFlags(client)
    assert rank1.dropped("v3-a") == {}
    assert not master.check([f"{StoreFlags.DROPS}v3-a/n"])  # asking made no key
    rank0.drop_target("v3-a", "r2", "went silent mid-stream")
    rank0.drop_target("v3-a", "r1", "went silent too\nacross lines")
    rank0.drop_target("v3-a", "r2", "a later reason is not the first")
    deadline = time.monotonic() + 5
    while len(rank1.dropped("v3-a")) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rank1.dropped("v3-a") == {"r2": "went silent mid-stream", "r1": "went silent too\nacross lines"}
    assert rank1.dropped("v3-b") == {}


class _SeenFlags(LocalFlags):
    """LocalFlags that count, per thread, the reads that saw a drop (each rank's follower reads)."""

    def __init__(self):
        super().__init__()
        self.readers: set[int] = set()

    def dropped(self, sync_id):
        out = super().dropped(sync_id)
        if out:
            self.readers.add(threading.get_ident())
        return out


class _HeldRank(RankActor):
    """A sender rank that stops after its first tensors until the test releases it."""

    def __init__(self, rank, state, owners, flags, release: threading.Event):
        super().__init__(rank, state, owners)
        self.stream_flags, self.release = flags, release

    def export_own_tensors(self, stats=None):
        for i, item in enumerate(super().export_own_tensors(stats)):
            if i == 2:
                assert self.release.wait(30), "the test never released the senders"
            yield item


def test_a_target_dropped_by_rank_0_mid_stream_leaves_every_senders_stream_and_the_other_commits_exactly(request):
    src, state, owners, m, rollouts = _setup(tmp_bucket=4 << 10)
    (tx0, rx0), (tx1, rx1) = rollouts
    proxy = BusProxy("127.0.0.2", 0, ("127.0.0.1", rx1.port))
    request.addfinalizer(proxy.close)
    proxy.links.stall_after[-1] = 8 << 10  # a hung host: past its first buckets it takes nothing more
    flags, release = _SeenFlags(), threading.Event()
    try:
        job = SendJob.make(
            m, {"r0": f"127.0.0.1:{rx0.port}", "r1": f"127.0.0.2:{proxy.sock.getsockname()[1]}"}, TOKEN, 30
        )
        ranks = [_HeldRank(r, state, owners, flags, release) for r in (0, 1)]
        results: list = []
        t = threading.Thread(target=lambda: results.extend(_run(ranks, job)))
        t.start()
        flags.drop_target(m.sync_id, "r1", "stream: UNAVAILABLE: the rollout went silent mid-stream")
        deadline = time.monotonic() + 10
        while len(flags.readers) < 2 and time.monotonic() < deadline:  # both ranks' followers read it
            time.sleep(0.01)
        assert len(flags.readers) == 2
        release.set()
        t.join(60)
        out = merge(m, results)
        assert out.error == "" and set(out.failures) == {"r1"}, out
        assert all("went silent mid-stream" in r.failures["r1"] for r in results), [r.failures for r in results]
        version, _, _ = tx0.commit(m.sync_id, 7, dict(enumerate(out.checksums)))
        assert version == 7
        (_, logits), _ = tx0.serve(lambda e: e.score(IDS, 1), timeout=5)
        assert torch.equal(logits, src.score(IDS, 1)[1])
    finally:
        release.set()
        for tx, rx in rollouts:
            tx.abort(m.sync_id, "test over")
            rx.stop()


def test_a_follower_drops_each_target_once_and_never_trips_the_rank():
    class Sender:
        def __init__(self):
            self.dropped = []

        def drop(self, tid, why):
            self.dropped.append((tid, why))
            return True

    flags, sender = LocalFlags(), Sender()
    follower = DropFollower(flags, "s1", sender)
    follower.poll()
    flags.drop_target("s1", "r1", "silent")
    flags.drop_target("s2", "r2", "another sync")
    follower.poll()
    follower.poll()
    assert sender.dropped == [("r1", "silent")] and follower.tripped == ""
