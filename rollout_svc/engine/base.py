"""The contract between rollout-svc's sync transaction and an inference engine.

An engine generates, scores, and loads HF-named tensors. It knows nothing about versions,
manifests or transports: the transaction (rollout_svc.sync.transaction) decides when to pause,
load, flush and resume, so the built-in engine and SGLang share one sync implementation.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from weightsync.bus.plan import TensorMeta


#: Temperatures below this sample greedily, as SGLang does (its _SAMPLING_EPS): logits / T would
#: overflow to inf for a denormal T, and such a T is greedy in all but name.
GREEDY_BELOW = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0         # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1                       # samples per prompt

    def validate(self) -> None:
        if not 1 <= self.max_new_tokens <= 32768:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be in [1, 32768]")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"sampling.temperature={self.temperature} must be a finite number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 1 <= self.n <= 1024:
            raise ValueError(f"sampling.n={self.n} must be in [1, 1024]")


@dataclass
class SampleResult:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    prefix_cache_hit: bool = False


class Engine(Protocol):
    name: str

    def param_metas(self) -> dict[str, TensorMeta]:
        """HF name -> shape/dtype of every tensor `load_weights` accepts (full, unsharded shapes)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given tensors into the model. Partial sets are allowed (bucket by bucket)."""

    def flush_cache(self) -> None:
        """Drop every cached KV / prefix entry; called after every weight update."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[SampleResult]: ...

    def score(self, token_ids: list[int], prompt_length: int) -> tuple[list[float], torch.Tensor]:
        """Teacher-forced log-probs of token_ids[prompt_length:] and the last position's fp32 logits."""

    def num_ranks(self) -> int: ...

    def num_parameters(self) -> int: ...

    def prefix_cache_entries(self) -> int: ...


# Optional capabilities, looked up with getattr by rollout_svc.sync.transaction (in-place mode):
#   begin_apply()                    — called when the first bucket of a sync arrives (pause generation)
#   load_bucket(plan, buf)           — load a whole flat bucket (instead of load_weights(unpack(...)))
#   end_apply()                      — called at commit instead of flush_cache (flush + resume)
#   loads_quantized(quantization)    — True: take block-FP8 pairs (X, X_scale_inv) as they are; absent
#                                      or False: receive X dequantized (rollout_svc/quantized.py)
#   writable_params(metas)           — the parameters a bucket's tensors can be written into byte for
#                                      byte (or None), so the copy out of the bus buffer is also its
#                                      checksum pass (weightsync/bus/verified_copy.py)
# The SGLang adapter implements the first four; the built-in engine only writable_params.
