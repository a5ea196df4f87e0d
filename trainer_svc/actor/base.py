"""The contract between the trainer service and a model backend (Megatron-core or transformers).

Each backend is one package, `trainer_svc/actor/<backend>/`, holding the actor and its training
backend (`train_backend()`); the service and `trainer_svc/train/` reach training only through it.

The sync orchestrator only needs: the list of HF tensors the actor will export (metadata,
without gathering anything), and an iterator that yields those tensors in exactly that order.
A multi-rank backend runs its collectives inside these methods on every rank; through
`export_tensors` only global rank 0 receives real tensors (the funnel), the other ranks'
iterators yield nothing.

A multi-rank backend may also let every rank that assembles tensors stream them itself
(weightsync/publisher/multisender.py): it then offers `export_owners()` (the global rank assembling each
tensor of `export_metas()`, from metadata alone) and `run_senders(job)` (rank 0: hand the job to
every rank, stream this rank's part, return every rank's report). Backends without them stream
from rank 0. Every optional ability the publisher uses is declared, with its default, on
weightsync.publisher.source.WeightSource, which `Actor` extends: a backend overrides what it offers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from weightsync.bus.plan import TensorMeta
from weightsync.publisher.source import WeightSource

if TYPE_CHECKING:
    from trainer_svc.train.backend import TrainBackend
    from trainer_svc.train.step import TrainState


class Actor(WeightSource):
    """The base of every backend's actor (HfActor, MegatronActor)."""

    #: model family key of the rule table, e.g. "qwen2", "llama", "qwen3"
    family: str
    #: bumped whenever the weights change (load, train step); a sync publishes this version
    version: int
    #: completed optimizer steps (0 until the first TrainStep)
    step: int
    #: optimizer, reference model and step count; None until the first training call builds it
    train_state: TrainState | None

    def export_metas(self) -> list[TensorMeta]:
        """HF name, shape and export dtype of every tensor, in export order."""
        raise NotImplementedError

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) in `export_metas()` order, memory bounded by the largest tensor."""
        raise NotImplementedError

    def load_hf(self, path: str) -> None:
        """Load an HF safetensors directory into the model; bumps `version`."""
        raise NotImplementedError

    def num_parameters(self) -> int:
        raise NotImplementedError

    def describe_parallelism(self) -> str:
        raise NotImplementedError

    def hf_config(self):
        """The transformers PretrainedConfig this actor mirrors."""
        raise NotImplementedError

    def train_backend(self) -> TrainBackend:
        """A new training backend over this actor's parameters (forward/backward, clipping, optimizer)."""
        raise NotImplementedError
