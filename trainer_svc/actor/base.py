"""The contract between the trainer service and a model backend (Megatron-core or transformers).

The sync orchestrator only needs: the list of HF tensors the actor will export (metadata,
without gathering anything), and an iterator that yields those tensors in exactly that order.
A multi-rank backend runs its collectives inside these methods on every rank; only the bus
sender rank (global rank 0) receives real tensors, the other ranks' iterators yield nothing.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from weightsync.bus.plan import TensorMeta


class Actor(Protocol):
    #: model family key of the rule table, e.g. "qwen2", "llama", "qwen3"
    family: str
    #: bumped whenever the weights change (load, train step); a sync publishes this version
    version: int

    def export_metas(self) -> list[TensorMeta]:
        """HF name, shape and export dtype of every tensor, in export order."""

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) in `export_metas()` order, memory bounded by the largest tensor."""

    def load_hf(self, path: str) -> None:
        """Load an HF safetensors directory into the model; bumps `version`."""

    def num_parameters(self) -> int: ...

    def describe_parallelism(self) -> str: ...

    def hf_config(self):
        """The transformers PretrainedConfig this actor mirrors."""
