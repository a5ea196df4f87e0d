"""One sync attempt's steps (prepare, stream, commit, abort) against fake rollouts and a fake channel."""

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync.bus.channel import BucketSender
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.errors import TransportError
from weightsync.bus.layout import ManifestCache
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.bus.session import Session
from weightsync.publisher.attempt import SyncAttempt
from weightsync.publisher.delta_sync import DeltaBase
from weightsync.publisher.export_format import PLAIN
from weightsync.publisher.phases import PhaseClock
from weightsync.publisher.registry import RolloutEntry
from weightsync.publisher.source import WeightSource
from weightsync.v1 import bus_pb2, rollout_pb2

METAS = [TensorMeta(f"w{i}", (32,), torch.float32) for i in range(3)]
TENSORS = {m.name: torch.full(m.shape, float(i)) for i, m in enumerate(METAS)}


class _Actor(WeightSource):
    def export_tensors(self):
        return iter(TENSORS.items())


class _Orch:
    """What an attempt uses of the orchestrator (attempt.Fleet): the actor, the calls to rollouts (here the fleet
    itself), the RPC threads, the layout cache and the trainer's identity."""

    origin = "o1"
    trainer_id = "trainer-test"
    rpc_timeout = 5.0
    export_format = PLAIN
    liveness_timeout = None  # as over gRPC: no liveness signal

    def __init__(self, refuse_prepare=(), silent=()):
        self.actor, self.refuse_prepare, self.silent = _Actor(), set(refuse_prepare) | set(silent), set(silent)
        self.manifests, self.pool = ManifestCache(), ThreadPoolExecutor(max_workers=4)
        self.calls: list[tuple[str, str]] = []
        self.failed: list[tuple[str, str]] = []
        self.rollouts = self
        self.delta = DeltaBase("full")
        #: rollout_id -> the reason its AbortSync answer gives for having aborted on its own
        self.aborted_reason: dict[str, str] = {}

    def call(self, entry, method, req, timeout=None, link=True):
        self.calls.append((entry.rollout_id, method))
        if method == "PrepareSync":
            if entry.rollout_id in self.refuse_prepare:
                return None, "UNAVAILABLE: connection refused"
            resp = rollout_pb2.PrepareSyncResponse()
            resp.transport.tcp.data_address = "h:1"
            return resp, ""
        if method == "CommitSync":
            return rollout_pb2.CommitSyncResponse(version=req.version), ""
        return rollout_pb2.AbortSyncResponse(aborted_reason=self.aborted_reason.get(entry.rollout_id, "")), ""

    def send(self, entry, method, req, timeout=None):
        """A call on the target's link in two halves (a commit sent as the last bucket goes out)."""
        if self.link_of(entry) is None:
            return None
        answer = self.call(entry, method, req)
        return lambda: answer

    def fail(self, result, entry, reason, err):
        result.ok, result.error = False, err
        self.failed.append((entry.rollout_id, reason))

    def link_of(self, entry):
        return None  # every call through call()

    def gone(self, entry):
        return entry.rollout_id in self.silent

    def heard_since(self, entry, since):
        return None  # as over gRPC: no liveness signal (a fleet with one: tests/unit/.../test_straggler_drop.py)


class _Channel(BucketSender):
    def __init__(self, fail=False):
        self.fail, self.sent, self.closed = fail, [], False
        self.dropped: dict[str, str] = {}  # rollout_id -> why its stream broke (failures())

    def send(self, plan, buf, checksum):
        if self.fail:
            raise TransportError("peer gone")
        self.sent.append((plan.index, checksum, bucket_checksum(buf[: plan.nbytes])))

    def failures(self):
        return dict(self.dropped)

    def close(self):
        self.closed = True


class _Session(Session):
    name, device, reused = "tcp", torch.device("cpu"), False

    def __init__(self, group_wide=False, fail=False):
        self.group_wide, self.channel, self.finished = group_wide, _Channel(fail), None

    def spec_for(self, entry):
        spec = bus_pb2.TransportSpec()
        spec.tcp.SetInParent()
        return spec

    def accept(self, entry, resp):
        return ""

    def open(self, targets, timeout):
        self.targets = sorted(targets)
        return self.channel

    def finish(self, ok, reason):
        self.finished = (ok, reason)


def _attempt(orch, session, rids=("a", "b")):
    manifest = make_manifest(METAS, version=7, sync_id="s1", bucket_bytes=256)
    targets = [RolloutEntry(rid, f"h:{i}") for i, rid in enumerate(rids)]
    phases = PhaseClock()
    return SyncAttempt(orch, session, manifest, targets, time.monotonic() + 60, phases), manifest, targets, phases


def test_prepared_targets_commit_and_a_target_that_failed_prepare_is_aborted():
    orch, session = _Orch(refuse_prepare={"b"}), _Session()
    attempt, manifest, (a, b), phases = _attempt(orch, session)
    results, retry = attempt.run()
    assert retry == []
    assert results["a"].ok and results["a"].version == 7
    assert (a.version, a.origin, a.state) == (7, "o1", rollout_pb2.SERVING)
    assert not results["b"].ok and results["b"].error == "prepare: UNAVAILABLE: connection refused"
    assert orch.failed == [("b", "prepare_failed")]
    assert session.targets == ["a"] and session.finished[0] is True
    assert [(i, c) for i, c, _ in session.channel.sent] == [(i, c) for i, _, c in session.channel.sent]
    assert len(session.channel.sent) == len(manifest.buckets) and session.channel.closed
    assert ("a", "CommitSync") in orch.calls and ("b", "CommitSync") not in orch.calls
    assert ("b", "AbortSync") in orch.calls and ("a", "AbortSync") not in orch.calls
    assert sorted(phases.seconds) == ["commit", "prepare", "stream", "stream.export", "stream.pack"]


def test_a_target_gone_silent_is_failed_but_not_aborted():
    """An AbortSync to a rollout that went silent would only wait for it, holding the Sync; its own
    timer aborts what it prepared."""
    orch, session = _Orch(silent={"b"}), _Session()
    attempt, *_ = _attempt(orch, session)
    results, _ = attempt.run()
    assert results["a"].ok and not results["b"].ok and orch.failed == [("b", "prepare_failed")]
    assert ("b", "AbortSync") not in orch.calls


def test_a_broken_stream_takes_the_rollouts_own_reason_data_loss():
    """The rollout found a corrupted bucket and closed its stream: the trainer saw a broken pipe, and
    the AbortSync answer says why, so the result and the failure reason say DATA_LOSS."""
    orch, session = _Orch(), _Session()
    session.channel.dropped = {"a": "tcp stream to h:0: [Errno 32] Broken pipe", "b": "tcp stream to h:1: reset"}
    orch.aborted_reason = {"a": "DATA_LOSS: bucket 0: checksum 0x1 != sender's 0x2 (corrupted in transit)"}
    attempt, *_ = _attempt(orch, session)
    results, _ = attempt.run()
    err = results["a"].error
    assert err.startswith("DATA_LOSS: bucket 0: checksum") and "Broken pipe" in err, err
    assert results["b"].error == "tcp stream to h:1: reset"  # no reason from the rollout: as the trainer saw it
    assert sorted(orch.failed) == [("a", "data_loss"), ("b", "transport")]
    assert ("a", "CommitSync") not in orch.calls and ("b", "CommitSync") not in orch.calls


def test_group_wide_attempt_stops_and_names_the_members_that_prepared_for_a_retry():
    orch, session = _Orch(refuse_prepare={"b"}), _Session(group_wide=True)
    attempt, *_ = _attempt(orch, session, rids=("a", "b", "c"))
    results, retry = attempt.run()
    assert [e.rollout_id for e in retry] == ["a", "c"]
    assert (
        not results["a"].ok
        and "not started: every member of the group must prepare, and b: prepare:" in results["a"].error
    )
    assert orch.failed == [("b", "prepare_failed")]  # the retried members are not counted as failures
    assert session.channel.sent == [] and session.finished == (False, "no target prepared")
    assert not any(m == "CommitSync" for _, m in orch.calls)
    assert sorted(r for r, m in orch.calls if m == "AbortSync") == ["a", "b", "c"]


def test_a_stream_failure_fails_every_prepared_target_and_commits_none():
    orch, session = _Orch(), _Session(fail=True)
    attempt, *_ = _attempt(orch, session)
    results, retry = attempt.run()
    assert retry == [] and not any(r.ok for r in results.values())
    assert results["a"].error == "tcp stream: peer gone"
    assert sorted(orch.failed) == [("a", "transport"), ("b", "transport")]
    assert session.finished == (False, "stream: peer gone") and session.channel.closed
    assert not any(m == "CommitSync" for _, m in orch.calls)
    assert sorted(r for r, m in orch.calls if m == "AbortSync") == ["a", "b"]


def _fp8_attempt(orch, session, bad: str):
    """An attempt over the block-FP8 stream of three projections, one of them holding a NaN."""
    from weightsync.publisher.export_format import FP8_BLOCK, export_format

    fmt = export_format(FP8_BLOCK)
    named = [(f"model.layers.{i}.self_attn.q_proj.weight", torch.randn(8, 8)) for i in range(3)]
    dict(named)[bad][3, 4] = float("nan")
    manifest = make_manifest(
        fmt.metas(TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named),
        version=7,
        sync_id="s1",
        bucket_bytes=256,
        quantization=fmt.quantization,
    )
    targets = [RolloutEntry(rid, f"h:{i}") for i, rid in enumerate(("a", "b"))]
    attempt = SyncAttempt(
        orch, session, manifest, targets, time.monotonic() + 60, PhaseClock(), tensors=lambda: fmt.tensors(iter(named))
    )
    return attempt, manifest


def test_non_finite_fp8_weights_fail_the_stream_after_its_last_bucket_and_nothing_commits():
    orch, session = _Orch(), _Session()
    attempt, manifest = _fp8_attempt(orch, session, bad="model.layers.1.self_attn.q_proj.weight")
    results, _ = attempt.run()
    want = (
        "tcp stream: tensor model.layers.1.self_attn.q_proj.weight: block [0, 0] holds inf or nan; refusing "
        "to export it as FP8 (the trainer's weights have diverged)"
    )
    assert [r.error for r in results.values()] == [want, want]
    # the check is deferred to the end of the export: every bucket went out, and none was committed
    assert len(session.channel.sent) == len(manifest.buckets) > 2
    assert session.finished == (False, want.removeprefix("tcp "))
    assert not any(m == "CommitSync" for _, m in orch.calls)
    assert sorted(r for r, m in orch.calls if m == "AbortSync") == ["a", "b"]


def test_an_export_error_after_a_failed_stream_joins_the_errors_and_the_targets_are_still_aborted():
    orch, session = _Orch(), _Session(fail=True)
    attempt, _ = _fp8_attempt(orch, session, bad="model.layers.0.self_attn.q_proj.weight")
    results, retry = attempt.run()  # the drain's error does not escape past the aborts
    assert retry == [] and not any(r.ok for r in results.values())
    assert results["a"].error == (
        "tcp stream: peer gone; the export failed too: tensor "
        "model.layers.0.self_attn.q_proj.weight: block [0, 0] holds inf or nan; refusing "
        "to export it as FP8 (the trainer's weights have diverged)"
    )
    assert sorted(r for r, m in orch.calls if m == "AbortSync") == ["a", "b"]


def test_the_trainers_own_prepare_work_runs_while_the_rollouts_answer_prepare_sync():
    """`meanwhile` starts once every PrepareSync is out: a rollout that answers only after it ran
    proves the overlap (run after the answers, it would time out)."""
    import threading

    ran = threading.Event()
    orch, session = _Orch(), _Session()
    answer = orch.call

    def call(entry, method, req):
        if method == "PrepareSync" and not ran.wait(10):
            return None, "UNAVAILABLE: the trainer waited for this answer before its own work"
        return answer(entry, method, req)

    orch.call = call
    attempt, _, _, _ = _attempt(orch, session)
    attempt.prepare(meanwhile=ran.set)
    assert sorted(attempt.prepared) == ["a", "b"] and orch.failed == []


def test_a_failure_of_the_trainers_own_prepare_work_is_raised_after_the_requests_out_have_ended():
    import pytest

    orch, session = _Orch(), _Session()
    answer, answered = orch.call, []

    def call(entry, method, req):
        time.sleep(0.2)
        answered.append(entry.rollout_id)
        return answer(entry, method, req)

    def broken():
        raise RuntimeError("in-place views")

    orch.call = call
    attempt, _, _, _ = _attempt(orch, session)
    with pytest.raises(RuntimeError, match="in-place views"):
        attempt.prepare(meanwhile=broken)
    assert sorted(answered) == ["a", "b"]
    ran = []
    attempt, _, _, _ = _attempt(_Orch(), _Session(), rids=())
    attempt.prepare(meanwhile=lambda: ran.append(1))
    assert ran == [1]  # no target: it still runs
