"""Policy-gradient losses as pure tensor functions: GRPO advantages, PPO-clip, k3 KL, aggregation.

Every function takes per-token tensors shaped [B, T] with a {0,1} `mask` for the valid response
tokens, so the same code serves one micro-batch or a whole batch. Aggregation takes explicit
denominators (`num_tokens`, `num_seqs`) so that summing the losses of micro-batches gives exactly
the loss of the full batch — gradient accumulation must not change what is optimised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean_g) / (std_g + eps) within each group g of samples of one prompt.

    std is the unbiased sample std (as in the GRPO paper's reference code). A group whose rewards
    are all equal — or that has a single sample — carries no preference signal: its advantages are
    exactly 0, not (0 / eps) noise.
    """
    rewards = rewards.to(torch.float64)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        if r.numel() < 2:
            continue
        std = r.std()
        if float(std) <= 0.0:
            continue
        adv[idx] = (r - r.mean()) / (std + eps)
    return adv.to(torch.float32)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` [B, T] to a scalar.

    token-mean: sum of every valid token / `num_tokens` (all tokens of the batch weigh the same,
        long responses weigh more);
    seq-mean:   mean over sequences of each sequence's token mean / `num_seqs` (every response
        weighs the same, whatever its length).
    The denominators default to this tensor's own counts; pass the full batch's counts when
    `values` is one micro-batch of it.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
        return (values * mask).sum() / max(denom, 1.0)
    if mode == "seq-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        denom = values.shape[0] if num_seqs is None else float(num_seqs)
        return per_seq.sum() / max(denom, 1.0)
    raise ValueError(f"aggregation={mode!r} must be one of {list(AGGREGATIONS)}")


@dataclass
class ClipStats:
    clip_frac: torch.Tensor  # fraction of valid tokens where the clipped branch was taken
    dual_clip_frac: torch.Tensor  # fraction where the dual clip (negative advantages) bounded the loss
    ratio_mean: torch.Tensor
    approx_kl: torch.Tensor  # mean of (old - new) log-prob: KL(old || new) estimate


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip_c: float = 0.0,
    aggregation: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, ClipStats]:
    """PPO-clip policy loss with asymmetric clip range [1 - clip_low, 1 + clip_high].

    Per token: max(-A r, -A clip(r)); with dual clip (c > 1) a negative-advantage token's loss is
    further bounded by -A c, so one huge ratio on a bad token cannot dominate the batch
    (Ye et al. 2020). `advantages` is [B] (broadcast over tokens) or [B, T].
    """
    clip_high = clip_low if clip_high is None else clip_high
    if dual_clip_c and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1 (or 0 = off)")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).float()
    dual = torch.zeros_like(loss)
    if dual_clip_c:
        bound = -advantages * dual_clip_c
        neg = advantages < 0
        dual = (neg & (loss > bound)).float()
        loss = torch.where(neg, torch.minimum(loss, bound), loss)
    m = mask.to(loss.dtype)
    n = m.sum().clamp(min=1.0)
    with torch.no_grad():
        stats = ClipStats(
            clip_frac=(clipped * m).sum() / n,
            dual_clip_frac=(dual * m).sum() / n,
            ratio_mean=(ratio * m).sum() / n,
            approx_kl=(-log_ratio * m).sum() / n,
        )
    return aggregate(loss, mask, aggregation, num_tokens=num_tokens, num_seqs=num_seqs), stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token low-variance KL(π || π_ref) estimator (Schulman's k3): e^(ref-logp) - (ref-logp) - 1.

    Unbiased for samples drawn from π, always >= 0. The log-ratio is clamped so that a token the
    reference finds impossible cannot produce inf.
    """
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0
