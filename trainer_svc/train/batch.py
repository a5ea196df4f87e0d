"""Samples (prompt + response token ids) → padded next-token training tensors, and micro-batches.

Layout: row i holds prompt_i + response_i, right-padded to the micro-batch's longest row.
`targets[i, t]` is the token at t + 1, and `mask[i, t]` is 1 where that token is a response token,
so the logits at position t score exactly the response tokens and nothing else. Right padding
never changes the real positions' outputs under causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L] int64, 0-padded
    attention: torch.Tensor  # [B, L] 1 for real tokens
    targets: torch.Tensor  # [B, L] int64: tokens shifted left
    mask: torch.Tensor  # [B, L] float: 1 where targets[i, t] is a response token
    old_logp: torch.Tensor  # [B, L] behaviour log-probs on the mask (0 elsewhere)
    has_old_logp: bool  # every sample carried rollout log-probs
    advantages: torch.Tensor  # [B]
    ref_logp: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def slice(self, lo: int, hi: int) -> "Batch":
        """Rows [lo, hi), trimmed to their own longest row."""
        width = int(self.attention[lo:hi].sum(-1).max())
        cut = lambda t: None if t is None else t[lo:hi, :width]  # noqa: E731
        return replace(
            self,
            tokens=cut(self.tokens),
            attention=cut(self.attention),
            targets=cut(self.targets),
            mask=cut(self.mask),
            old_logp=cut(self.old_logp),
            advantages=self.advantages[lo:hi],
            ref_logp=cut(self.ref_logp),
        )

    def micro_batches(self, size: int) -> list["Batch"]:
        size = size or self.size
        return [self.slice(i, min(i + size, self.size)) for i in range(0, self.size, size)]

    def rows(self, per_token: torch.Tensor) -> list[list[float]]:
        """Per-sample lists of the masked entries of a [B, L] tensor (response tokens in order)."""
        return [per_token[i][self.mask[i] > 0].tolist() for i in range(self.size)]


def make_batch(samples, advantages: torch.Tensor | None = None) -> Batch:
    """Tensorise TrainSample-like objects (prompt_ids, response_ids, rollout_logprobs)."""
    n = len(samples)
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lens)
    tokens = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    old = torch.zeros(n, width)
    has_old = all(len(s.rollout_logprobs) for s in samples)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, : p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        attention[i, : p + r] = 1
        mask[i, p - 1 : p + r - 1] = 1.0
        if has_old:
            old[i, p - 1 : p + r - 1] = torch.tensor(list(s.rollout_logprobs), dtype=torch.float32)
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    adv = torch.zeros(n) if advantages is None else advantages.float()
    return Batch(tokens, attention, targets, mask, old, has_old, adv)
