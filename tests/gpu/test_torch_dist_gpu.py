"""Megatron torch_dist checkpoints on CUDA (NCCL, 2 GPUs): the CPU test's cases (saved at TP=2 PP=1
under each key spelling, loaded at TP=1 PP=2 bit-exactly, exporting the HF tensors exactly; wrong
checkpoints refused) with the model on the GPUs. Run on a GPU host:

    pytest -m gpu tests/gpu/test_torch_dist_gpu.py
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_torch_dist_tp2_to_pp2_on_gpus(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from tests.support.torch_dist_case import check_torch_dist_across_layouts

    # the worker script picks NCCL and cuda:LOCAL_RANK itself when CUDA is present
    check_torch_dist_across_layouts(tmp_path)
