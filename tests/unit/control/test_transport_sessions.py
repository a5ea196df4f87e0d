"""Transport sessions of the trainer and the rollout's GPU checks, with fakes for what needs a GPU."""
import threading

import pytest
import torch

from rollout_svc.transaction import SyncError
from weightsync.bus.errors import TransportError
from weightsync.bus.gpu import require_cuda
from weightsync.bus.ipc.handles import HandleCache
from weightsync.bus.ipc.receiver import check_ipc
from weightsync.bus.ipc.sender import IpcPushSender, IpcSender
from weightsync.bus.nccl.sender import NcclGroupCache
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.v1 import bus_pb2, rollout_pb2


class _Group:
    def __init__(self, world):
        self.world, self.aborted, self.healthy = world, "", True

    def abort(self, reason):
        self.aborted, self.healthy = reason, False


class _Bus:
    needs_cuda = False

    def __init__(self):
        self.ids = 0
        self.opened = []

    def new_unique_id(self):
        self.ids += 1
        return bytes([self.ids]) * 128

    def open_group(self, uid, world, rank, device, timeout):
        assert rank == 0
        g = _Group(world)
        self.opened.append(g)
        return g


def test_group_cache_is_keyed_by_membership_and_rebuilt_after_a_failure():
    bus = _Bus()
    cache = NcclGroupCache(bus, torch.device("cpu"))
    p1 = cache.plan([("b", "h:2"), ("a", "h:1")])
    assert p1.fresh and p1.world_size == 3 and (p1.rank_of("a"), p1.rank_of("b")) == (1, 2)
    g1 = cache.join(p1, timeout=5)
    p2 = cache.plan([("a", "h:1"), ("b", "h:2")])
    assert not p2.fresh and p2.unique_id == p1.unique_id and p2.group_id == p1.group_id
    assert cache.join(p2, timeout=5) is g1 and cache.builds == 1
    # the same id at another address is another member (the pod was replaced)
    p3 = cache.plan([("a", "h:9"), ("b", "h:2")])
    assert p3.fresh and p3.unique_id != p1.unique_id and g1.aborted == "membership changed"
    g3 = cache.join(p3, timeout=5)
    g3.abort("NCCL error 6")
    p4 = cache.plan([("a", "h:9"), ("b", "h:2")])
    assert p4.fresh and p4.group_id != p3.group_id
    cache.join(p4, timeout=5)
    cache.invalidate("sync failed")
    assert cache.plan([("a", "h:9"), ("b", "h:2")]).fresh and cache.builds == 3
    with pytest.raises(KeyError, match="not a member"):
        p4.rank_of("zz")


def test_require_cuda_and_ipc_device_checks():
    with pytest.raises(SyncError, match=r"transport nccl needs a CUDA engine.*runs on cpu.*--device cuda:N") as e:
        require_cuda(torch.device("cpu"), "nccl", "builtin")
    assert e.value.code == "FAILED_PRECONDITION"
    gpu1 = torch.device("cuda:1")
    assert require_cuda(gpu1, "nccl", "builtin") == gpu1
    uuid_of = {1: "GPU-bbbb"}.__getitem__
    spec = bus_pb2.IpcTransport(device_uuid="GPU-aaaa")
    with pytest.raises(SyncError, match="trainer's buffers are on GPU GPU-aaaa, this rollout's engine is on GPU-bbbb") as e:
        check_ipc(spec, gpu1, "builtin", uuid_of=lambda d: uuid_of(d.index))
    assert e.value.code == "FAILED_PRECONDITION"
    assert check_ipc(bus_pb2.IpcTransport(device_uuid="GPU-bbbb"), gpu1, "builtin",
                     uuid_of=lambda d: uuid_of(d.index)) == "GPU-bbbb"
    with pytest.raises(SyncError, match="device_uuid is empty") as e:
        check_ipc(bus_pb2.IpcTransport(), gpu1, "builtin", uuid_of=lambda d: "x")
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(SyncError, match="transport ipc needs a CUDA engine"):
        check_ipc(spec, torch.device("cpu"), "builtin", uuid_of=lambda d: "x")


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
