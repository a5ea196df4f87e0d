"""The trainer's end of CUDA IPC: the session's GPU check and the IpcBuckets stream, with fakes for the GPU and the
stream."""

import queue
import threading
import time

import grpc
import pytest
import torch

from weightsync.bus.errors import TransportError
from weightsync.bus.ipc.handles import HandleCache
from weightsync.bus.ipc.sender import IpcSender
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.v1 import bus_pb2, rollout_pb2


class _Entry:
    def __init__(self, rid):
        self.rollout_id = rid


def test_trainer_ipc_session_refuses_a_rollout_on_another_gpu():
    ipc = IpcSender(torch.device("cpu"), call=None, uuid_of=lambda d: "GPU-trainer", needs_cuda=False)
    s = ipc.begin([_Entry("r")], "s1", 1 << 20)
    spec = s.spec_for(_Entry("r"))
    assert spec.ipc.device_uuid == "GPU-trainer"
    resp = rollout_pb2.PrepareSyncResponse()
    resp.transport.ipc.device_uuid = "GPU-other"
    assert "engine is on GPU GPU-other, the trainer on GPU-trainer" in s.accept(_Entry("r"), resp)
    resp.transport.ipc.device_uuid = "GPU-trainer"
    assert s.accept(_Entry("r"), resp) == ""
    resp.transport.tcp.data_address = "h:1"
    assert "answered an ipc prepare with transport tcp" in s.accept(_Entry("r"), resp)
    with pytest.raises(ValueError, match="transport=ipc needs the trainer's export on the rollouts' GPU"):
        IpcSender(torch.device("cpu"), call=None).begin([_Entry("r")], "s", 1)


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class _Call:
    """What the trainer's end uses of grpc's stream call, over a plain response iterator: iteration,
    cancel(), and add_done_callback(), whose callback runs once the responses are read out."""

    def __init__(self, responses):
        self._responses = responses
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._responses)

    def cancel(self) -> None:
        self.cancelled = True

    def add_done_callback(self, callback) -> None:
        for _ in self._responses:
            pass
        callback(self)


def _fake_streams(got: dict, fail_at: dict):
    """Stands in for the IpcBuckets call: acknowledges each request in order, as the rollout does."""

    def open_stream(entry, method, requests, timeout):
        assert method == "IpcBuckets" and timeout > 0

        def responses():
            for req in requests:
                got[entry.rollout_id].append((req.sync_id, req.index, req.ipc.handle, req.checksum))
                if fail_at.get(entry.rollout_id) == req.index:
                    raise _RpcError(grpc.StatusCode.DATA_LOSS, f"bucket {req.index}: checksum mismatch")
                yield rollout_pb2.PushBucketResponse(index=req.index)

        return _Call(responses())

    return open_stream


def _share_counting(calls):
    def share(t):
        calls.append(t.untyped_storage().data_ptr())
        return bus_pb2.CudaIpcHandle(handle=str(t.untyped_storage().data_ptr()).encode())

    return share


def _cpu_ipc(stream, share_calls: list | None = None) -> IpcSender:
    """An IpcSender on the CPU whose rollouts all report one GPU, streaming through the fake `stream`;
    each share of a buffer's handle is noted in `share_calls`."""
    return IpcSender(
        torch.device("cpu"),
        call=None,
        uuid_of=lambda d: "GPU-t",
        needs_cuda=False,
        stream=stream,
        cache=HandleCache(_share_counting([] if share_calls is None else share_calls)),
    )


def _numbered(metas) -> dict[str, torch.Tensor]:
    """Each tensor of `metas` filled with its position in the list."""
    return {m.name: torch.full(m.shape, float(i)) for i, m in enumerate(metas)}


def test_ipc_stream_shares_each_long_lived_buffer_once_across_syncs_and_drops_a_failing_target():
    """Five regular buckets through two pooled buffers plus one oversized tensor, synced twice:
    the pool's buffers are shared once for both syncs, the one-off tensor once per sync."""
    metas = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(5)] + [TensorMeta("big", (1024,), torch.float32)]
    manifest = make_manifest(metas, version=1, sync_id="s1", bucket_bytes=256)
    assert len(manifest.buckets) == 6
    got: dict[str, list] = {"ok": [], "bad": []}
    share_calls: list[int] = []
    ipc = _cpu_ipc(_fake_streams(got, {"bad": 2}), share_calls)
    targets = {"ok": _Entry("ok"), "bad": _Entry("bad")}
    for sync_id in ("s1", "s2"):
        tensors = _numbered(metas)
        session = ipc.begin(list(targets.values()), sync_id, manifest.bucket_bytes)
        sender = session.open(targets, timeout=30)
        stats = stream_buckets(manifest, iter(tensors.items()), sender, timeout=30, buffers=session.buffers)
        session.finish(True, "")
        assert [i for s, i, _, _ in got["ok"] if s == sync_id] == list(range(6))
        assert [c for s, _, _, c in got["ok"] if s == sync_id] == stats.checksums
        assert [i for s, i, _, _ in got["bad"] if s == sync_id] == [0, 1, 2]  # dropped at its failing bucket
        assert sender.failures() == {"bad": "IpcBuckets, bucket 2: DATA_LOSS: bucket 2: checksum mismatch"}
        sender.close()
    pooled = {h for s, i, h, _ in got["ok"] if i < 5}
    assert len(pooled) == 2 and ipc.buffers.allocations == 1
    assert len(share_calls) == 2 + 2  # two pool buffers once, the oversized tensor once per sync


def test_ipc_stream_waits_for_the_previous_acknowledgement_and_fails_when_no_target_is_left():
    got: dict[str, list] = {"r": []}
    metas = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(3)]
    manifest = make_manifest(metas, version=1, sync_id="s", bucket_bytes=256)
    ipc = _cpu_ipc(_fake_streams(got, {"r": 1}))
    sender = ipc.begin([_Entry("r")], "s", 256).open({"r": _Entry("r")}, timeout=30)
    buf = torch.zeros(256, dtype=torch.uint8)
    sender.send(manifest.buckets[0], buf, 1)
    assert got["r"] == []  # queued: the acknowledgement of bucket 0 is awaited with bucket 1's send
    with pytest.raises(TransportError, match="every rollout dropped off the IPC bus: IpcBuckets, bucket 1"):
        sender.send(manifest.buckets[1], buf, 2)
        sender.flush()
    assert [i for _, i, _, _ in got["r"]] == [0, 1]
    with pytest.raises(ValueError, match="no IpcBuckets stream opener"):
        IpcSender(torch.device("cpu"), call=None, needs_cuda=False).begin([_Entry("r")], "s", 256).open({}, 1)


def test_in_place_buckets_are_long_lived_for_the_handle_cache():
    ipc = _cpu_ipc(_fake_streams({}, {}))
    flats = [torch.zeros(512, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8)]
    session = ipc.begin([_Entry("r")], "s", 256)
    assert not ipc.long_lived(flats[1][:10])
    session.use_in_place(flats)
    assert ipc.long_lived(flats[0][:100]) and ipc.long_lived(flats[1]) and not ipc.long_lived(torch.zeros(4))


def test_held_buckets_go_out_without_waiting_for_acknowledgements_and_only_the_first_carries_its_checksum():
    """The actor's own storage is never refilled during a sync: nothing waits per bucket, and
    flush reads every acknowledgement in order."""
    got: dict[str, list] = {"r": []}
    metas = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(4)]
    manifest = make_manifest(metas, version=1, sync_id="s", bucket_bytes=256)
    ipc = _cpu_ipc(_fake_streams(got, {}))
    flats = [torch.full((256,), i, dtype=torch.uint8) for i in range(len(manifest.buckets))]
    session = ipc.begin([_Entry("r")], "s", 256)
    session.use_in_place(flats)
    sender = session.open({"r": _Entry("r")}, timeout=30)
    assert sender.checksums_in_band == "first"
    awaited, real_await = [], sender._await
    sender._await = lambda index: (awaited.append((index, len(sender._unacked))), real_await(index))
    stats = stream_buckets(manifest, iter(()), sender, timeout=30, in_place=flats)
    assert awaited == [(len(flats) - 1, len(flats))]  # once, at flush, for every bucket
    assert [i for _, i, _, _ in got["r"]] == list(range(len(flats)))
    assert [c for _, _, _, c in got["r"]] == [stats.checksums[0]] + [0] * (len(flats) - 1)
    assert sender.failures() == {} and sender._unacked == []
    sender.close()


def _committing_streams(got: dict, refuse: set):
    """IpcBuckets that acknowledges buckets and answers a commit message (or refuses it, as CommitSync would)."""

    def open_stream(entry, method, requests, timeout):
        def responses():
            for req in requests:
                got[entry.rollout_id].append("commit" if req.HasField("commit") else req.index)
                if req.HasField("commit"):
                    if entry.rollout_id in refuse:
                        raise _RpcError(grpc.StatusCode.DATA_LOSS, "bucket 1: checksum 0x1 != trainer's 0x2")
                    answer = rollout_pb2.CommitSyncResponse(version=req.commit.version)
                    yield rollout_pb2.PushBucketResponse(commit=answer)
                    return
                yield rollout_pb2.PushBucketResponse(index=req.index)

        return _Call(responses())

    return open_stream


def test_targets_that_commit_on_their_stream_keep_it_open_past_flush_and_get_the_commit_answer_on_it():
    got: dict[str, list] = {"s": [], "u": [], "bad": []}
    metas = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(3)]
    manifest = make_manifest(metas, version=4, sync_id="s", bucket_bytes=256)
    ipc = _cpu_ipc(_committing_streams(got, {"bad"}))
    targets = {rid: _Entry(rid) for rid in got}
    sender = ipc.begin(list(targets.values()), "s", 256).open(targets, timeout=30)
    sender.commit_on_stream(["s", "bad", "not-a-target"])
    tensors = _numbered(metas)
    stream_buckets(manifest, iter(tensors.items()), sender, timeout=30, buffers=ipc.buffers)
    assert got == {"s": [0, 1, 2], "u": [0, 1, 2], "bad": [0, 1, 2]} and sender.failures() == {}
    req = rollout_pb2.CommitSyncRequest(sync_id="s", version=4)
    assert sender.commit("s", req) == (rollout_pb2.CommitSyncResponse(version=4), "")
    assert sender.commit("bad", req) == (None, "DATA_LOSS: bucket 1: checksum 0x1 != trainer's 0x2")
    resp, err = sender.commit("u", req)  # its stream ended at flush: it commits with CommitSync
    assert resp is None and "no IpcBuckets stream open to u" in err
    assert got["s"][-1] == "commit" and got["bad"][-1] == "commit" and got["u"] == [0, 1, 2]
    sender.close()


def test_targets_that_commit_elsewhere_have_their_stream_ended_at_flush_and_its_end_read_at_close():
    """A target that commits over its sync link: flush sends the end of its stream but does not
    wait for the rollout's (a round trip in the stream phase); close reads it before cancelling."""
    ends_read: list[str] = []

    def open_stream(entry, method, requests, timeout):
        def responses():
            for req in requests:
                yield rollout_pb2.PushBucketResponse(index=req.index)
            ends_read.append(entry.rollout_id)  # the trainer asked for more after the last ack

        return _Call(responses())

    metas = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(3)]
    manifest = make_manifest(metas, version=4, sync_id="s", bucket_bytes=256)
    ipc = _cpu_ipc(open_stream)
    targets = {rid: _Entry(rid) for rid in ("linked", "plain")}
    sender = ipc.begin(list(targets.values()), "s", 256).open(targets, timeout=30)
    sender.commit_elsewhere(["linked", "not-a-target"])
    tensors = _numbered(metas)
    stream_buckets(manifest, iter(tensors.items()), sender, timeout=30, buffers=ipc.buffers)
    assert ends_read == ["plain"] and sender.failures() == {}
    sender.close()
    assert ends_read == ["plain", "linked"]


class _HangingCall:
    """An IpcBuckets call whose rollout acknowledges buckets but never answers the commit; cancel
    ends it the way grpc does (the blocked read raises CANCELLED)."""

    def __init__(self, requests):
        self._requests, self._out = requests, queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        for req in self._requests:
            if not req.HasField("commit"):
                self._out.put(rollout_pb2.PushBucketResponse(index=req.index))

    def __iter__(self):
        return self

    def __next__(self):
        item = self._out.get(timeout=30)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self._out.put(_RpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))


def test_a_commit_on_the_stream_not_answered_within_the_timeout_fails_as_a_deadline():
    metas = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(2)]
    manifest = make_manifest(metas, version=4, sync_id="s", bucket_bytes=256)
    ipc = _cpu_ipc(lambda entry, method, requests, timeout: _HangingCall(requests))
    sender = ipc.begin([_Entry("r")], "s", 256).open({"r": _Entry("r")}, timeout=30)
    sender.commit_on_stream(["r"])
    tensors = _numbered(metas)
    stream_buckets(manifest, iter(tensors.items()), sender, timeout=30, buffers=ipc.buffers)
    t0 = time.monotonic()
    resp, err = sender.commit("r", rollout_pb2.CommitSyncRequest(sync_id="s", version=4), timeout=0.2)
    assert resp is None and err == "DEADLINE_EXCEEDED: IpcBuckets: the commit was not answered within 0.2s"
    assert time.monotonic() - t0 < 5
    sender.close()
