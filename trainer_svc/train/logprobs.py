"""Token log-probs and entropy from logits, unsharded or vocab-parallel across a TP group.

With tensor parallelism the output layer is column-parallel: each TP rank holds the logits of a
contiguous vocab slice [rank * V/tp, (rank + 1) * V/tp). Log-softmax then needs three all-reduces
over the TP group — the max (for stability, no gradient), the sum of exponentials, and the target
logit (only its owner contributes) — instead of gathering [B, T, V] logits on one rank.

The all-reduces inside the graph use an identity backward: every TP rank computes the same
scalar loss from the reduced values, so d loss / d (local partial sum) equals d loss / d (sum);
each rank then back-propagates into its own logit shard only (megatron's column-parallel layer
all-reduces the input gradient itself).
"""

from __future__ import annotations

import torch


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _tp_world(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduceSumIdentityGrad.apply(x, group)


def _valid_columns(logits: torch.Tensor, group, vocab_size: int | None) -> torch.Tensor | None:
    """Bool [V_local] of real vocab columns, or None when every column is real.

    Megatron pads the vocabulary to a multiple of 128 * TP; the padded rows of the output layer
    are real parameters with real logits, and must not take probability mass.
    """
    world, rank = _tp_world(group)
    v = logits.shape[-1]
    if vocab_size is None or (rank + 1) * v <= vocab_size:
        return None
    return torch.arange(rank * v, (rank + 1) * v, device=logits.device) < vocab_size


def _shifted(logits: torch.Tensor, group, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits - global max, global max); the max carries no gradient (logsumexp is shift-invariant)."""
    src = logits.detach() if valid is None else logits.detach().masked_fill(~valid, float("-inf"))
    m = src.amax(-1, keepdim=True).clamp(min=-1e30)
    if _tp_world(group)[0] > 1:
        import torch.distributed as dist

        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return logits - m, m


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position; logits [..., V_local] (fp32 math).

    With `tp_group`, `logits` is this rank's vocab shard and `targets` hold global token ids;
    columns at global index >= `vocab_size` (vocab padding) are excluded.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    world, rank = _tp_world(group=tp_group)
    valid = _valid_columns(logits, tp_group, vocab_size)
    z, _ = _shifted(logits, tp_group, valid)
    e = z.exp() if valid is None else z.exp().masked_fill(~valid, 0.0)
    if world == 1:
        return torch.gather(z, -1, targets.unsqueeze(-1)).squeeze(-1) - e.sum(-1).log()
    v = z.shape[-1]
    lo = rank * v
    local = targets - lo
    own = (local >= 0) & (local < v)
    picked = torch.gather(z, -1, local.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1) * own
    target_logit = _reduce_sum(picked, tp_group)
    sum_exp = _reduce_sum(e.sum(-1), tp_group)
    return target_logit - sum_exp.log()


def token_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, tp_group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position; H = log S - Σ e^z z / S with z = logits - max."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    valid = _valid_columns(logits, tp_group, vocab_size)
    z, _ = _shifted(logits, tp_group, valid)
    e = z.exp()
    if valid is not None:
        z, e = z.masked_fill(~valid, 0.0), e.masked_fill(~valid, 0.0)
    s, w = e.sum(-1), (e * z).sum(-1)
    if _tp_world(tp_group)[0] > 1:
        s, w = _reduce_sum(s, tp_group), _reduce_sum(w, tp_group)
    return s.log() - w / s
