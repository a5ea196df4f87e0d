"""What the backend-neutral training code needs from an actor's training backend.

Each actor backend (`trainer_svc/actor/hf/`, `trainer_svc/actor/megatron/`) ships one, handed out by
`Actor.train_backend()`; the step driver, log-prob scoring and checkpoints see only this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from trainer_svc.train.batch import Batch


class TrainBackend(Protocol):
    #: tensor-parallel group the logits' vocab dimension is split over (None: not split)
    tp_group: object
    #: full vocabulary size when the logits are a TP shard (None: the logits' last dim)
    vocab_size: int | None

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's trainable parameters (what the optimizer steps)."""

    def modules(self) -> list[torch.nn.Module]:
        """The model chunks a checkpoint saves and loads, in a fixed order."""

    def frozen_copy(self) -> list[torch.nn.Module]:
        """A no-grad copy of the current weights (the KL reference model)."""

    def run(
        self,
        mbs: list[Batch],
        fn: Callable,
        out_shape: Callable,
        *,
        train: bool,
        modules: list[torch.nn.Module] | None = None,
    ) -> list[torch.Tensor]:
        """`fn(logits, mb) -> (loss or None, out)` on every micro-batch; back-propagates when `train`;
        returns the outs, valid on every rank."""

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the global grad norm (0 = off) and apply the optimizer; returns the norm before clipping."""

    def make_optimizer(self, optim) -> torch.optim.Optimizer:
        """AdamW over `parameters()` with the trainer's `optim` section."""

    def barrier(self) -> None:
        """Wait for every trainer rank (a no-op in one process)."""
