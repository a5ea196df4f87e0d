"""weightsync.bus.nccl.liveness on its own: the watch's verdicts and the abort flags on a real store."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from weightsync.bus.nccl.liveness import StoreFlags, Watch, members_probe
from weightsync.v1 import rollout_pb2


def test_store_flags_raised_by_one_rank_are_seen_by_another_per_sync():
    # rank 0 hosts the job's TCPStore; another rank is a client of it, as under torchrun
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    rank0, rank1 = (
        StoreFlags(dist.PrefixStore("default_pg", master)),
        StoreFlags(dist.PrefixStore("default_pg", client)),
    )
    assert rank1.raised("v3-a") == ""
    rank0.raise_flag("v3-a", "rollout r1 became unreachable during the stream")
    # A read on another connection right after the set may not see it yet (this test flaked in CI
    # reading it at once): the ranks poll, and so does the test.
    deadline = time.monotonic() + 5
    while not rank1.raised("v3-a") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rank1.raised("v3-a") == "rollout r1 became unreachable during the stream"
    assert rank1.raised("v3-b") == ""  # another sync's flag is its own


def test_watch_aborts_once_on_the_first_verdict_and_ignores_failing_probes():
    answers = iter([RuntimeError("store unreachable"), "", "rank 0 ended it", "again"])
    aborted, done = [], threading.Event()

    def probe():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    def abort(reason):
        aborted.append(reason)
        done.set()

    w = Watch(probe, abort, 0.01).start()
    assert done.wait(5)
    time.sleep(0.05)
    assert aborted == ["rank 0 ended it"] and w.tripped == "rank 0 ended it"


def test_a_stopped_watch_gives_no_verdict():
    aborted = []
    w = Watch(lambda: "too late", aborted.append, 0.05).start()
    w.stop()
    time.sleep(0.2)
    assert aborted == [] and w.tripped == ""


def test_members_probe_names_the_dead_and_the_departed_and_passes_busy_or_present_members():
    status = {
        "ok": (rollout_pb2.RolloutStatus(pending_sync_id="s1"), ""),
        "busy": (None, "DEADLINE_EXCEEDED: slow"),
        "gone": (None, "UNAVAILABLE: connection refused"),
        "left": (rollout_pb2.RolloutStatus(pending_sync_id="", last_error="checksum mismatch"), ""),
    }

    def call(entry, method, req):
        assert method == "GetStatus"
        return status[entry]

    assert members_probe({"a": "ok", "b": "busy"}, call, "s1")() == ""
    assert members_probe({"a": "ok", "g": "gone"}, call, "s1")() == (
        "rollout g became unreachable during the stream (UNAVAILABLE: connection refused)"
    )
    assert members_probe({"l": "left"}, call, "s1")() == "rollout l left sync s1 during the stream (checksum mismatch)"
    # sent its CommitSync before the last broadcast completed: no longer holding the sync may mean it
    # committed it, which its commit's answer says; unreachable is still a verdict
    committing = members_probe({"l": "left", "a": "ok"}, call, "s1")
    committing.committing.add("l")
    assert committing() == ""
    dead = members_probe({"g": "gone"}, call, "s1")
    dead.committing.add("g")
    assert dead() == "rollout g became unreachable during the stream (UNAVAILABLE: connection refused)"


def test_members_probe_is_not_held_up_by_a_member_whose_answer_hangs():
    """A member that answers only after its RPC timeout must not hide one that died meanwhile, and is
    not asked again while its call is still out (one thread per hung member, not one per round)."""
    release = threading.Event()
    asked = {"hung": 0, "dead": 0}

    def call(entry, method, req):
        asked[entry] += 1
        if entry == "hung":
            release.wait(10)
            return None, "DEADLINE_EXCEEDED: no answer"
        return None, "UNAVAILABLE: connection refused"

    probe = members_probe({"h": "hung", "d": "dead"}, call, "s1", wait_s=5.0)
    try:
        t0 = time.monotonic()
        assert probe() == "rollout d became unreachable during the stream (UNAVAILABLE: connection refused)"
        assert time.monotonic() - t0 < 1.0  # the verdict came at once, not after the hung call or wait_s
        probe()
        assert asked == {"hung": 1, "dead": 2}
    finally:
        release.set()
        probe.close()
    assert probe() == ""  # a closed probe asks nobody


def test_a_watch_over_members_aborts_on_a_death_while_another_member_hangs():
    release = threading.Event()

    def call(entry, method, req):
        if entry == "hung":
            release.wait(10)
            return None, "DEADLINE_EXCEEDED: no answer"
        if entry == "dies" and time.monotonic() > died_at:
            return None, "UNAVAILABLE: connection refused"
        return rollout_pb2.RolloutStatus(pending_sync_id="s1"), ""

    died_at = time.monotonic() + 0.2
    aborted, done = [], threading.Event()
    probe = members_probe({"h": "hung", "x": "dies"}, call, "s1", wait_s=0.05)
    w = Watch(probe, lambda r: (aborted.append(r), done.set()), 0.05, on_stop=probe.close).start()
    try:
        assert done.wait(3), "the death was not seen while the other member hung"
        assert aborted == ["rollout x became unreachable during the stream (UNAVAILABLE: connection refused)"]
    finally:
        release.set()
        w.stop()
