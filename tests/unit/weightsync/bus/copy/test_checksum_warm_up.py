"""The start-up warm-up of the checksum is free off-GPU (the GPU case: tests/gpu/test_bus_gpu.py)."""

import torch

from weightsync.bus.copy.checksum import warm_up


def test_warm_up_is_a_no_op_without_a_gpu():
    assert warm_up(torch.device("cpu")) == 0.0
    assert warm_up(None) == 0.0
    assert warm_up("cpu") == 0.0
