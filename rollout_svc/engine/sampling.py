"""Logits → next token, and the log-probs reported with each sampled token.

The reported log-prob is log_softmax(logits / T) at the chosen token (T = 1 when greedy, which
includes every T below GREEDY_BELOW),
taken *before* top-k / top-p truncation: that is the quantity a trainer recomputes from its own
logits, so the train/inference mismatch metric compares like with like.
"""

from __future__ import annotations

import torch

from rollout_svc.engine.base import GREEDY_BELOW, SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop = probs.cumsum(-1) - probs >= top_p
        # ...stated outright: a top_p below fp32's smallest value compares as 0 and would drop all
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def choose(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (fp32) → (tokens [B], logprobs [B])."""
    logits = logits.float()
    if sp.temperature < GREEDY_BELOW:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1)
    else:
        scaled = logits / sp.temperature
        logp = torch.log_softmax(scaled, -1)
        filtered = _filter_top_k_top_p(scaled, sp.top_k, sp.top_p)
        probs = torch.softmax(filtered, -1)
        tokens = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
