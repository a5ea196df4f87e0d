"""CUDA IPC handle caching and the GPU transport messages, checked without a GPU."""

import pytest
import torch

from weightsync.bus.ipc.handles import HandleCache
from weightsync.bus.pack import alloc_buffer
from weightsync.v1 import bus_pb2, rollout_pb2


class _FakeShare:
    """Stands in for storage._share_cuda_ (CUDA only): a handle naming the storage it was made from."""

    def __init__(self):
        self.calls = []

    def __call__(self, t: torch.Tensor) -> bus_pb2.CudaIpcHandle:
        self.calls.append(t)
        return bus_pb2.CudaIpcHandle(
            handle=str(t.untyped_storage().data_ptr()).encode(),
            storage_size=t.untyped_storage().nbytes(),
            device_uuid="GPU-fake",
        )


def test_reusable_buffers_are_shared_once_and_one_offs_every_time():
    share = _FakeShare()
    cache = HandleCache(share)
    bufs = [alloc_buffer(1024), alloc_buffer(1024)]
    handles = [cache.handle(bufs[i % 2][: 100 + i], reusable=True)[0] for i in range(6)]
    assert cache.shares == 2 and len(share.calls) == 2
    assert handles[0] == handles[2] == handles[4] and handles[1] == handles[3] and handles[0] != handles[1]
    big = torch.arange(64, dtype=torch.float32)
    for _ in range(2):
        h, keep = cache.handle(big.view(torch.uint8), reusable=False)
        assert keep.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()  # no copy needed
    assert cache.shares == 4


def test_a_view_that_does_not_start_its_storage_is_copied_before_sharing():
    share = _FakeShare()
    base = torch.arange(32, dtype=torch.uint8)
    h, keep = HandleCache(share).handle(base[8:], reusable=False)
    assert keep.storage_offset() == 0 and torch.equal(keep, base[8:])
    assert keep.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="must start its storage"):
        HandleCache(share).handle(base[8:], reusable=True)


def test_gpu_transport_messages_round_trip():
    req = rollout_pb2.PrepareSyncRequest(timeout_seconds=7.5)
    req.transport.nccl.CopyFrom(
        bus_pb2.NcclTransport(
            unique_id=bytes(range(128)), world_size=3, rank_offset=2, group_id="g-1", timeout_seconds=30, new_group=True
        )
    )
    back = rollout_pb2.PrepareSyncRequest.FromString(req.SerializeToString())
    assert back.transport.WhichOneof("kind") == "nccl"
    n = back.transport.nccl
    assert (n.unique_id, n.world_size, n.rank_offset, n.group_id, n.timeout_seconds, n.new_group) == (
        bytes(range(128)),
        3,
        2,
        "g-1",
        30.0,
        True,
    )
    resp = rollout_pb2.PrepareSyncResponse(num_ranks=1)
    resp.transport.ipc.CopyFrom(bus_pb2.IpcTransport(host_id="node-1", device_uuid="GPU-1234"))
    back = rollout_pb2.PrepareSyncResponse.FromString(resp.SerializeToString())
    assert back.transport.WhichOneof("kind") == "ipc"
    assert (back.transport.ipc.host_id, back.transport.ipc.device_uuid) == ("node-1", "GPU-1234")
