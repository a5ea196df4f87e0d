"""The rollout's mapping cache: one open per buffer and pairing; drops for a new trainer or an unused buffer."""

import pytest
import torch

from weightsync.bus.ipc.handles import MappedBuffers
from weightsync.v1 import bus_pb2


def _handle(name: bytes, size=64, offset=0):
    return bus_pb2.CudaIpcHandle(handle=name, storage_size=size, storage_offset=offset, device_uuid="GPU-x")


def test_each_buffer_is_opened_once_per_pairing_and_dropped_when_unused_or_the_trainer_changes():
    memory = {b"A": torch.arange(64, dtype=torch.uint8), b"B": torch.zeros(64, dtype=torch.uint8)}
    opened = []
    maps = MappedBuffers(
        lambda h: opened.append(bytes(h.handle)) or memory[bytes(h.handle)], on_open=lambda: opened.append("metric")
    )
    maps.begin("trainer-1")
    for _ in range(3):
        assert torch.equal(maps.get(_handle(b"A"), 10), memory[b"A"][:10])
        maps.get(_handle(b"B"), 64)
    assert opened == [b"A", "metric", b"B", "metric"] and maps.opens == 2 and len(maps) == 2
    maps.begin("trainer-1")  # next sync of the same trainer: both kept
    maps.get(_handle(b"A"), 64)
    assert maps.opens == 2
    maps.begin("trainer-1")  # the last sync did not use B: its mapping goes
    assert len(maps) == 1
    maps.get(_handle(b"A", offset=8), 16)  # another storage in the same allocation is another mapping
    assert maps.opens == 3
    maps.begin("trainer-2")  # another trainer: nothing of the old one is kept
    assert len(maps) == 0
    with pytest.raises(ValueError, match="cannot hold the 65 bytes"):
        maps.get(_handle(b"A"), 65)
