"""The trainer's end of CUDA IPC: the session's GPU check and the push channel, with fakes for the GPU."""
import threading

import pytest
import torch

from weightsync.bus.errors import TransportError
from weightsync.bus.ipc.handles import HandleCache
from weightsync.bus.ipc.sender import IpcPushSender, IpcSender
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


def test_ipc_sender_shares_each_pipeline_buffer_once_and_drops_a_failing_target():
    """Five regular buckets through the pipeline's two buffers plus one oversized tensor: three shares."""
    metas = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(5)] + [TensorMeta("big", (1024,), torch.float32)]
    tensors = {m.name: torch.full(m.shape, float(i)) for i, m in enumerate(metas)}
    manifest = make_manifest(metas, version=1, sync_id="s1", bucket_bytes=256)
    assert len(manifest.buckets) == 6
    got: dict[str, list] = {"ok": [], "bad": []}
    lock = threading.Lock()

    def call(entry, method, req):
        assert method == "PushBucket" and req.sync_id in ("s1", "s2")
        with lock:
            got[entry.rollout_id].append((req.index, req.ipc.handle, req.checksum))
        return (None, "UNAVAILABLE: gone") if entry.rollout_id == "bad" else (object(), "")

    share_calls = []

    def share(t):
        share_calls.append(t.untyped_storage().data_ptr())
        return bus_pb2.CudaIpcHandle(handle=str(t.untyped_storage().data_ptr()).encode())

    sender = IpcPushSender({"ok": _Entry("ok"), "bad": _Entry("bad")}, "s1", call, manifest.bucket_bytes,
                           cache=HandleCache(share))
    stats = stream_buckets(manifest, iter(tensors.items()), sender, timeout=30)
    assert [i for i, _, _ in got["ok"]] == list(range(6)) and [i for i, _, _ in got["bad"]] == [0]
    assert sender.failures() == {"bad": "PushBucket of bucket 0: UNAVAILABLE: gone"}
    assert len(share_calls) == 3 and len({h for _, h, _ in got["ok"][:5]}) == 2
    assert [c for _, _, c in got["ok"]] == stats.checksums
    sender.close()

    lone = IpcPushSender({"bad": _Entry("bad")}, "s2", call, manifest.bucket_bytes, cache=HandleCache(share))
    with pytest.raises(TransportError, match="every rollout dropped off the IPC bus"):
        lone.send(manifest.buckets[0], torch.zeros(256, dtype=torch.uint8), None)
