"""One target on its sync link: PrepareSync is sent, the trainer's own prepare work runs, and the answer is
read, all on the sync's thread (weightsync/publisher/attempt.py `_prepare_answers`).

Against fake calls (test_attempt.py's fleet) whose link half records the order of events and the thread
each ran on: the request goes out before the trainer's work, the answer is read after it, with no RPC
thread in between; a failure of either part fails cleanly (the trainer's work raises after the answer
was read, freeing the link; a refused prepare fails the target, the work having run once); a link that
cannot take the call, or several targets, take the threaded path as before."""

from __future__ import annotations

import threading

import pytest
from test_attempt import _attempt, _Orch, _Session

from weightsync.bus.layout import layout_digest
from weightsync.v1 import rollout_pb2


class _LinkedOrch(_Orch):
    """Every target on a sync link; `send` is the link's first half (None: it could not take the call)."""

    def __init__(self, refuse_prepare=(), link_down=False):
        super().__init__(refuse_prepare=refuse_prepare)
        self.events: list[tuple[str, str]] = []  # (event, thread name)
        self.link_down = link_down
        self.pool_submits = 0
        submit = self.pool.submit

        def counting_submit(*a, **k):
            self.pool_submits += 1
            return submit(*a, **k)

        self.pool.submit = counting_submit

    def link_of(self, entry):
        return object()

    def send(self, entry, method, req, timeout=None):
        if self.link_down:
            return None
        self.events.append((f"sent {method}", threading.current_thread().name))

        def finish():
            self.events.append((f"read {method}", threading.current_thread().name))
            return self.call(entry, method, req)

        return finish


def _work(orch, fail: bool = False):
    def meanwhile():
        orch.events.append(("work", threading.current_thread().name))
        if fail:
            raise RuntimeError("in-place views")

    return meanwhile


def test_one_linked_target_is_prepared_on_the_syncs_own_thread_around_the_trainers_work():
    orch = _LinkedOrch()
    attempt, _, _, _ = _attempt(orch, _Session(), rids=("a",))
    attempt.prepare(meanwhile=_work(orch))
    me = threading.current_thread().name
    assert orch.events == [("sent PrepareSync", me), ("work", me), ("read PrepareSync", me)]
    assert orch.pool_submits == 0 and list(attempt.prepared) == ["a"] and orch.failed == []
    assert ("a", "PrepareSync") in orch.calls


def test_a_failure_of_the_trainers_work_is_raised_once_the_answer_was_read():
    orch = _LinkedOrch()
    attempt, _, _, _ = _attempt(orch, _Session(), rids=("a",))
    with pytest.raises(RuntimeError, match="in-place views"):
        attempt.prepare(meanwhile=_work(orch, fail=True))
    # the link is free again for the AbortSync that follows: its answer was read, not left on the wire
    assert [e for e, _ in orch.events] == ["sent PrepareSync", "work", "read PrepareSync"]


def test_a_refused_prepare_fails_the_target_after_the_trainers_work_ran_once():
    orch = _LinkedOrch(refuse_prepare={"a"})
    attempt, _, _, _ = _attempt(orch, _Session(), rids=("a",))
    attempt.prepare(meanwhile=_work(orch))
    assert [e for e, _ in orch.events].count("work") == 1
    assert attempt.prepared == {} and orch.failed == [("a", "prepare_failed")]
    assert "prepare: UNAVAILABLE" in attempt.results["a"].error


def test_a_manifest_needed_answer_is_asked_again_in_full_and_the_work_runs_once():
    orch = _LinkedOrch()
    answer = orch.call
    asked = []

    def call(entry, method, req):
        asked.append(len(req.manifest.buckets))
        if len(asked) == 1:
            return rollout_pb2.PrepareSyncResponse(manifest_needed=True), ""
        return answer(entry, method, req)

    orch.call = call
    attempt, manifest, (a,), _ = _attempt(orch, _Session(), rids=("a",))
    manifest.layout_digest = layout_digest(manifest)
    orch.manifests.learned(a, manifest.layout_digest)  # it is sent the digest alone first
    attempt.prepare(meanwhile=_work(orch))
    assert asked == [0, len(manifest.buckets)] and list(attempt.prepared) == ["a"]
    assert [e for e, _ in orch.events].count("work") == 1


@pytest.mark.parametrize("link_down, rids", [(True, ("a",)), (False, ("a", "b"))])
def test_a_link_that_cannot_take_the_call_or_several_targets_go_through_the_rpc_threads(link_down, rids):
    orch = _LinkedOrch(link_down=link_down)
    attempt, _, _, _ = _attempt(orch, _Session(), rids=rids)
    attempt.prepare(meanwhile=_work(orch))
    assert not [e for e, _ in orch.events if e.startswith("sent")]
    assert orch.pool_submits == len(rids) and sorted(attempt.prepared) == list(rids)
