"""The rollout's GPU checks at PrepareSync (CUDA engine; for IPC, the trainer's GPU), with named fake GPUs."""

import pytest
import torch

from weightsync.bus.errors import SyncError
from weightsync.bus.gpu import require_cuda
from weightsync.bus.ipc.receiver import check_ipc
from weightsync.v1 import bus_pb2


def test_require_cuda_and_ipc_device_checks():
    with pytest.raises(SyncError, match=r"transport nccl needs a CUDA engine.*runs on cpu.*--device cuda:N") as e:
        require_cuda(torch.device("cpu"), "nccl", "builtin")
    assert e.value.code == "FAILED_PRECONDITION"
    gpu1 = torch.device("cuda:1")
    assert require_cuda(gpu1, "nccl", "builtin") == gpu1
    uuid_of = {1: "GPU-bbbb"}.__getitem__
    spec = bus_pb2.IpcTransport(device_uuid="GPU-aaaa")
    with pytest.raises(
        SyncError, match="trainer's buffers are on GPU GPU-aaaa, this rollout's engine is on GPU-bbbb"
    ) as e:
        check_ipc(spec, gpu1, "builtin", uuid_of=lambda d: uuid_of(d.index))
    assert e.value.code == "FAILED_PRECONDITION"
    assert (
        check_ipc(bus_pb2.IpcTransport(device_uuid="GPU-bbbb"), gpu1, "builtin", uuid_of=lambda d: uuid_of(d.index))
        == "GPU-bbbb"
    )
    with pytest.raises(SyncError, match="device_uuid is empty") as e:
        check_ipc(bus_pb2.IpcTransport(), gpu1, "builtin", uuid_of=lambda d: "x")
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(SyncError, match="transport ipc needs a CUDA engine"):
        check_ipc(spec, torch.device("cpu"), "builtin", uuid_of=lambda d: "x")


def test_the_bucket_being_consumed_names_the_handle_it_was_mapped_from():
    """An engine whose weights live in other processes (SGLang's workers) forwards the trainer's handle of the
    bucket it is given instead of copying the mapping (rollout_svc/engine/sglang_direct.py); only while the
    receiver consumes that bucket, and only for that buffer."""
    from types import SimpleNamespace

    from weightsync.bus.ipc.handles import source_handle
    from weightsync.bus.ipc.receiver import IpcReceiver
    from weightsync.v1 import rollout_pb2

    mapped = torch.zeros(64, dtype=torch.uint8)
    seen = []

    def consume_bucket(sync_id, index, buf, checksum, defer_check=False):
        seen.append((source_handle(buf), source_handle(torch.zeros(64, dtype=torch.uint8))))
        return False

    tx = SimpleNamespace(
        pending_manifest=lambda sync_id: SimpleNamespace(buckets=[SimpleNamespace(nbytes=48)]),
        consume_bucket=consume_bucket,
    )
    maps = SimpleNamespace(get=lambda h, nbytes: mapped[:nbytes], begin=lambda owner: None)
    rx = IpcReceiver(tx, None, "sglang", maps=maps)
    rx.start("s1", "GPU-aaaa")
    handle = bus_pb2.CudaIpcHandle(device_uuid="GPU-aaaa", handle=b"h1", storage_size=64)
    rx.push(rollout_pb2.PushBucketRequest(sync_id="s1", index=0, ipc=handle))
    assert seen == [(handle, None)]
    assert source_handle(mapped[:48]) is None  # not outside the consume
