"""The training backend for HfActor: a transformers model in one process, plain torch AdamW."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from trainer_svc.train.batch import Batch


class HfBackend:
    tp_group = None
    vocab_size = None

    def __init__(self, actor):
        self.actor = actor
        self.model = actor.model

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def frozen_copy(self) -> list[torch.nn.Module]:
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return [ref]

    def run(
        self,
        mbs: list[Batch],
        fn: Callable,
        out_shape: Callable,
        *,
        train: bool,
        modules: list[torch.nn.Module] | None = None,
    ) -> list[torch.Tensor]:
        """fn(logits [B, L, V], mb) -> (loss or None, out tensor); back-propagates each loss when train."""
        model = (modules or [self.model])[0]
        # eval mode throughout: RL trains without dropout so the trainer's log-probs are the rollout's.
        model.eval()
        outs = []
        for mb in mbs:
            with torch.set_grad_enabled(train):
                logits = model(input_ids=mb.tokens, attention_mask=mb.attention, use_cache=False).logits
                loss, out = fn(logits, mb)
                if train:
                    loss.backward()
            outs.append(out)
        return outs

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the global grad norm (0 = off, norm still reported) and apply the optimizer; returns the norm."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")) if params else 0.0
        optimizer.step()
        return float(norm)

    def make_optimizer(self, s) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=s.lr, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps, weight_decay=s.weight_decay
        )

    def barrier(self) -> None:
        pass
