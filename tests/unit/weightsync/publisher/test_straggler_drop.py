"""A phase's calls to every target at once never wait long on one that went silent (issue 37).

weightsync.publisher.straggler.gather against fake calls whose liveness the test sets; and a whole
SyncAttempt whose third target never acknowledges its PrepareSync: the other two commit, the silent
one is failed `silent` (no call waits on it), and when its prepare is answered late, AbortSync of
that very sync supersedes what it prepared; one silent only at commit is reported unconfirmed, and
its late commit (whole, atomic) is recorded when it comes. Mid-stream: weightsync.publisher.stream_liveness
drops a target whose link stops answering pings, and the attempt fails it `silent` while the others commit.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_attempt import _attempt, _Channel, _Orch, _Session

from weightsync.bus.errors import TransportError
from weightsync.publisher import straggler
from weightsync.publisher.straggler import GRACE_FLOOR_S, gather, grace_s
from weightsync.publisher.stream_liveness import StreamLiveness

POOL = ThreadPoolExecutor(max_workers=8)


def _after(seconds: float, value, release: threading.Event | None = None):
    def call():
        if release is not None:
            release.wait(30)
        else:
            time.sleep(seconds)
        return value

    return call


def test_the_grace_follows_the_answered_targets_own_progress():
    assert grace_s([]) == GRACE_FLOOR_S
    assert grace_s([0.01, 0.02]) == GRACE_FLOOR_S
    assert grace_s([0.05, 0.3]) == pytest.approx(straggler.GRACE_FACTOR * 0.3)


@pytest.mark.serial
def test_a_silent_target_is_dropped_a_grace_after_the_others_answered_and_its_late_answer_is_handed_on():
    release, late = threading.Event(), []
    calls = {"a": _after(0.02, "A"), "b": _after(0.3, "B"), "c": _after(0, "C", release)}
    heard = {"a": True, "b": True, "c": False}
    t0 = time.monotonic()
    got = gather(
        POOL, calls, lambda k, since: heard[k], time.monotonic() + 30, on_late=lambda k, v: late.append((k, v))
    )
    took = time.monotonic() - t0
    assert got.answers == {"a": "A", "b": "B"} and list(got.dropped) == ["c"]
    # c is dropped the grace a's answer sets after the requests went out; b (acknowledged) is waited for
    assert 0.3 <= took < 0.3 + 0.5, took
    assert grace_s([0.02]) - 0.01 <= got.dropped["c"] < 0.3, got.dropped
    release.set()
    deadline = time.monotonic() + 5
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late == [("c", "C")]


@pytest.mark.parametrize("heard", [True, None], ids=["acknowledged", "over-grpc"])
def test_a_target_that_acknowledged_or_gives_no_signal_is_waited_for(heard):
    """Slow is not gone: one that has the request in hand (it beats), or one over gRPC (no way to tell)."""
    calls = {"a": _after(0.01, "A"), "slow": _after(0.6, "S")}
    got = gather(POOL, calls, lambda k, since: True if k == "a" else heard, time.monotonic() + 30)
    assert got.answers == {"a": "A", "slow": "S"} and got.dropped == {}


def test_the_callers_own_work_runs_once_every_call_is_on_its_way(monkeypatch):
    """`meanwhile` (the trainer's GPU launches during prepare) holds the GIL: run first, it would hold
    the requests back and add its time to the round trip."""
    monkeypatch.setattr(straggler, "SENDING_WAIT_S", 5.0)  # a loaded CI host may take long to start a thread
    started, seen = set(), []

    def call(key):
        def run():
            started.add(key)
            time.sleep(0.05)
            return key

        return run

    for _ in range(5):
        started.clear()
        calls = {k: call(k) for k in ("a", "b", "c")}
        got = gather(
            POOL, calls, lambda k, since: None, time.monotonic() + 30, meanwhile=lambda: seen.append(set(started))
        )
        assert got.answers == {"a": "a", "b": "b", "c": "c"}
    assert seen == [{"a", "b", "c"}] * 5


def test_no_target_is_dropped_before_one_answered():
    """With nothing to compare against (every target silent so far) the calls' own timeouts decide."""
    calls = {"a": _after(0.4, "A"), "b": _after(0.4, "B")}
    got = gather(POOL, calls, lambda k, since: False, time.monotonic() + 30)
    assert got.answers == {"a": "A", "b": "B"} and got.dropped == {}


class _SilentOrch(_Orch):
    """Target c holds its PrepareSync (as a stopped process: no answer, no acknowledgement) until released."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.late_aborts: list = []

    def call(self, entry, method, req):
        if entry.rollout_id == "c" and method == "PrepareSync":
            self.release.wait(30)
        if entry.rollout_id == "c" and method == "AbortSync":
            self.late_aborts.append(req.sync_id)
        return super().call(entry, method, req)

    def heard_since(self, entry, since):
        return entry.rollout_id != "c" or self.release.is_set()


def test_a_silent_prepare_target_is_dropped_the_others_commit_and_its_late_prepare_is_aborted():
    orch, session = _SilentOrch(), _Session()
    attempt, manifest, (a, b, c), _ = _attempt(orch, session, rids=("a", "b", "c"))
    t0 = time.monotonic()
    results, retry = attempt.run()
    took = time.monotonic() - t0
    assert took < 2.0, took  # never the call's 30 s
    assert results["a"].ok and results["b"].ok and retry == []
    assert not results["c"].ok and "silent" in results["c"].error and "stale" in results["c"].error
    assert orch.failed == [("c", "silent")] and not c.reachable and c.version == 0
    assert session.targets == ["a", "b"]  # nothing streamed to it
    assert ("c", "CommitSync") not in orch.calls and ("c", "AbortSync") not in orch.calls
    orch.release.set()  # it resumes: its prepare is answered now, and superseded at once
    deadline = time.monotonic() + 5
    while not orch.late_aborts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert orch.late_aborts == [manifest.sync_id]


class _SilentAtCommit(_Orch):
    """Target c prepares and receives everything, then goes silent on its CommitSync until released."""

    def __init__(self):
        super().__init__()
        self.release, self.sent_commit = threading.Event(), threading.Event()

    def call(self, entry, method, req):
        if entry.rollout_id == "c" and method == "CommitSync":
            self.sent_commit.set()
            self.release.wait(30)
        return super().call(entry, method, req)

    def heard_since(self, entry, since):
        return entry.rollout_id != "c" or not self.sent_commit.is_set() or self.release.is_set()


def test_a_target_silent_at_commit_is_reported_unconfirmed_and_its_late_commit_is_recorded():
    orch, session = _SilentAtCommit(), _Session()
    attempt, _, (a, b, c), _ = _attempt(orch, session, rids=("a", "b", "c"))
    t0 = time.monotonic()
    results, _ = attempt.run()
    assert time.monotonic() - t0 < 2.0
    assert results["a"].ok and results["b"].ok and (a.version, b.version) == (7, 7)
    assert not results["c"].ok and "commit: UNAVAILABLE" in results["c"].error
    assert "commit unconfirmed" in results["c"].error and orch.failed == [("c", "silent")]
    assert ("c", "AbortSync") not in orch.calls  # it may be committing: an abort would only wait for it
    orch.release.set()  # it resumes and commits the version it verified, whole
    deadline = time.monotonic() + 5
    while c.version != 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.version == 7 and c.reachable


class _Link:
    """A sync link as the stream's liveness watch sees it: a live one answers every ping."""

    def __init__(self, alive: bool = True, open_: bool = True, clock=time.monotonic):
        self.alive, self.open, self.clock, self.pings = alive, open_, clock, 0
        self.last_heard = clock()

    def ping(self):
        if not self.open:  # no socket to ask on
            return False
        self.pings += 1
        if self.alive:
            self.last_heard = self.clock()
        return True


def test_the_stream_watch_drops_only_the_target_whose_link_stopped_answering_pings():
    links = {"live": _Link(), "gone": _Link(alive=False)}
    dropped = []
    t0 = time.monotonic()
    with StreamLiveness(links, 0.4, lambda rid, s: dropped.append((rid, s, time.monotonic() - t0)), period=0.05):
        deadline = time.monotonic() + 5
        while not dropped and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # the live one keeps answering: never dropped
    assert [d[0] for d in dropped] == ["gone"] and links["live"].pings > 5
    assert 0.4 <= dropped[0][1] < 0.4 + 0.2 and dropped[0][2] < 0.4 + 0.2, dropped


def test_a_link_that_is_not_open_is_not_judged_and_is_watched_once_it_opens():
    # the first sync of a pairing: its PrepareSync went over gRPC and named the link, which a broken
    # open left closed; a stream that outlasts the timeout must not drop the rollout for a silence
    # nobody could hear, and the count starts once a ping really goes out
    clock = _Clock()
    closed, gone = _Link(open_=False, clock=clock), _Link(alive=False, open_=False, clock=clock)
    dropped = []
    watch = StreamLiveness({"closed": closed, "gone": gone}, 1.0, lambda rid, s: dropped.append(rid), clock=clock)
    for _ in range(20):
        clock.t += 0.25
        watch.check()
    assert dropped == [] and closed.pings == gone.pings == 0
    closed.open = gone.open = True  # a call reopened them: from now on silence counts
    for _ in range(4):
        clock.t += 0.25
        watch.check()
    assert dropped == []
    clock.t += 0.25
    watch.check()
    assert dropped == ["gone"] and watch.dropped["gone"] == 1.0


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class _SlowReader:
    """A live link whose answers reach the trainer one round late (a busy process reads them late)."""

    def __init__(self, clock, alive=True):
        self.clock, self.alive, self.last_heard, self._asked = clock, alive, 0.0, False

    def ping(self):
        if self._asked and self.alive:
            self.last_heard = self.clock()  # the answer to the previous ping, read only now
        self._asked = True
        return True


def test_a_watch_that_could_not_run_drops_no_one_and_a_dead_link_is_still_dropped_on_schedule():
    clock = _Clock()
    links = {"live": _SlowReader(clock), "gone": _SlowReader(clock, alive=False)}
    dropped = []
    watch = StreamLiveness(links, 1.0, lambda rid, s: dropped.append(rid), period=0.25, clock=clock)
    watch.check()
    # the whole process was starved for 5 s (the GIL held by a long call): no ping went out, and the
    # rollout had not answered the one before either; its answer to the next comes a round later
    clock.t += 5.0
    links["live"]._asked = False
    watch.check()
    assert dropped == []
    for _ in range(3):  # back on schedule: the live one's answers come in, the dead one stays silent
        clock.t += 0.25
        watch.check()
    assert dropped == []
    clock.t += 0.25
    watch.check()
    assert dropped == ["gone"] and watch.dropped["gone"] >= 1.0


class _DroppableChannel(_Channel):
    """The bus channel of a fleet whose target c stops mid-stream: from bucket 2 on, a send blocks (its
    socket full) until c is dropped, as TcpBucketSender's does."""

    def __init__(self):
        super().__init__()
        self.out = threading.Event()

    def send(self, plan, buf, checksum):
        if plan.index >= 2 and not self.out.wait(30):
            raise TransportError("the send to c never returned")
        super().send(plan, buf, checksum)

    def drop(self, tid, why):
        if tid != "c" or self.out.is_set():
            return False
        self.dropped[tid] = why
        self.out.set()
        return True


class _StopsMidStream(_Orch):
    """Targets on sync links; c's link answers no ping once the stream began (a SIGSTOPped rollout)."""

    liveness_timeout = 0.4

    def __init__(self):
        super().__init__()
        self.links = {rid: _Link() for rid in "abc"}
        self.links["c"].alive = False

    def link_of(self, entry):
        return self.links[entry.rollout_id]

    def heard_since(self, entry, since):
        return True  # everyone answered prepare


def test_a_target_silent_mid_stream_is_dropped_from_it_the_others_commit_and_it_is_never_sent_a_call():
    orch, session = _StopsMidStream(), _Session()
    session.channel = _DroppableChannel()
    attempt, manifest, (a, b, c), _ = _attempt(orch, session, rids=("a", "b", "c"))
    assert len(manifest.buckets) > 2
    t0 = time.monotonic()
    results, retry = attempt.run()
    took = time.monotonic() - t0
    assert took < 0.4 + 1.0, took  # the liveness timeout and a little: never the send's 30 s
    assert results["a"].ok and results["b"].ok and (a.version, b.version) == (7, 7) and retry == []
    assert not results["c"].ok and orch.failed == [("c", "silent")]
    assert "silent mid-stream" in results["c"].error and "stale" in results["c"].error, results["c"].error
    assert not c.reachable and c.version == 0 and "c" in attempt.dropped
    # every bucket reached the others; c is sent neither its commit nor an abort that would wait on it
    assert [s[0] for s in session.channel.sent] == [p.index for p in manifest.buckets]
    assert ("c", "CommitSync") not in orch.calls and ("c", "AbortSync") not in orch.calls


class _Mute:
    """A link whose pings are never answered: a live rollout whose link thread cannot run (its process
    busy: trainer and rollout in one process during a big first sync)."""

    last_heard = 0.0

    def ping(self):
        return True


def test_a_target_still_receiving_is_not_dropped_for_a_mute_link_and_is_once_its_stream_stops():
    # issue 49: dropped only on silence AND no receive progress
    clock, sent = _Clock(), {"busy": 0}
    dropped = []
    watch = StreamLiveness({"busy": _Mute()}, 1.0, lambda rid, s: dropped.append(rid), clock=clock, progress=sent.get)
    for _ in range(20):  # 5 s, five liveness timeouts: unanswered, but its stream keeps moving
        clock.t += 0.25
        sent["busy"] += 16 << 20
        watch.check()
    assert dropped == []
    for _ in range(5):  # its stream stops too: dropped one timeout later
        clock.t += 0.25
        watch.check()
    assert dropped == ["busy"] and watch.dropped["busy"] == 1.0


def test_a_target_whose_link_carries_its_early_commit_is_left_to_that_calls_liveness():
    # its beats are read by the commit's answer, not by the watch: silence on the watch says nothing
    clock, dropped = _Clock(), []
    watch = StreamLiveness(
        {"committing": _Mute(), "mute": _Mute()}, 1.0, lambda rid, s: dropped.append(rid), clock=clock
    )
    watch.calling.add("committing")
    for _ in range(10):
        clock.t += 0.25
        watch.check()
    assert dropped == ["mute"]
