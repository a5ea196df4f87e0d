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
