"""Megatron torch_dist checkpoints (CPU, gloo, 2 ranks, one launch): saved at TP=2 PP=1 under each key
spelling (megatron-core's own, the Transformer-Engine spec's, the module names), loaded at TP=1 PP=2
bit-exactly (every parameter equal to an HF load at that layout) and exporting the HF tensors exactly,
for qwen2, llama, qwen3 and qwen3_moe (with a dense layer); a wrong checkpoint is refused by name.
The launch and its checks live in tests/support/torch_dist_case.py (the GPU test runs them too)."""

from __future__ import annotations

from tests.support.torch_dist_case import check_torch_dist_across_layouts


def test_torch_dist_tp2_to_pp2_every_spelling(tmp_path):
    check_torch_dist_across_layouts(tmp_path)
