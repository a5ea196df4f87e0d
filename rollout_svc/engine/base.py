"""The contract between rollout-svc's sync transaction and an inference engine.

An engine generates, scores, and loads HF-named tensors. It knows nothing about versions,
manifests or transports: the transaction (rollout_svc.sync.transaction) decides when to pause,
load, flush and resume, so the built-in engine and SGLang share one sync implementation.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from weightsync.bus.pack import unpack_bucket
from weightsync.bus.plan import BucketPlan, TensorMeta

#: Temperatures below this sample greedily, as SGLang does (its _SAMPLING_EPS): logits / T would
#: overflow to inf for a denormal T, and such a T is greedy in all but name.
GREEDY_BELOW = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # samples per prompt

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


class TokenOut(NamedTuple):
    """One generated token, as an engine that `streams_tokens` emits it."""

    sample: int  # the sample's index among its prompt's n
    token_id: int
    logprob: float
    finish_reason: str | None  # on the sample's last token: its SampleResult.finish_reason; else None


#: emit(prompt_index, tokens) -> finished: new tokens of one prompt's samples, in order (the built-in engine: one
#: decode step's; SGLang: one token per call, as its stream delivers them). It runs on the thread driving the engine,
#: between steps or stream items, and may raise to stop the request (its consumer is gone or stalled). It returns the
#: samples (their index among the prompt's n) it has seen enough of, or None: a stop string completed in their text.
#: The engine decodes no more of those: each ends with the token just emitted (its TokenOut said finish_reason None;
#: the caller knows why it ended), with finish_reason "stop", and the prompt's decoding stops once all of its samples
#: are done. The other samples get exactly the tokens they would have got (the batch is still sampled row by row), and
#: the caller cuts the text at the stop string as it would the whole answer (openai_api/text.py), so only the tokens
#: after a stop string are saved, never changed.
Emit = Callable[[int, list[TokenOut]], Iterable[int] | None]


class Engine(ABC):
    """An inference engine as the transaction and the service drive it.

    The abstract methods are what every engine must do. The rest are capabilities with defaults
    that suit an engine holding its weights in this process; an engine overrides the ones it does
    differently (the SGLang adapter: begin_apply, load_bucket, end_apply, loads_quantized, writable_params
    once its parameters are mapped; the built-in engine: writable_params)."""

    name: str = ""
    #: generate(..., step=f) calls f() before each prefill and decode step (f may raise to stop the
    #: request), so requests take turns between steps (rollout_svc/sync/engine_gate.py)
    yields_between_steps: bool = False
    #: generate(..., step=f) asks f() while the request runs and stops the request once f raises,
    #: without turns (the engine batches requests itself)
    stops_on_cancel: bool = False
    #: generate may be called from several threads at once and runs those calls together (the engine batches
    #: concurrent requests itself: SGLang's continuous batching, the built-in engine's shared decode steps,
    #: rollout_svc/engine/batcher.py), so pinned requests take no turns
    #: (rollout_svc/sync/engine_gate.py); False: one generate at a time, handing over between steps if it yields
    batches_requests: bool = False
    #: generate(..., emit=f) calls f with the tokens as they are sampled (token streaming; the built-in engine and the
    #: SGLang adapter) and stops the samples f says are finished (Emit); an engine without it answers whole, decoding
    #: each sample to a stop token or max_new_tokens, and a stream of it is sent at its end
    streams_tokens: bool = False

    @abstractmethod
    def param_metas(self) -> dict[str, TensorMeta]:
        """HF name -> shape/dtype of every tensor `load_weights` accepts (full, unsharded shapes)."""

    @abstractmethod
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given tensors into the model. Partial sets are allowed (bucket by bucket)."""

    @abstractmethod
    def flush_cache(self) -> None:
        """Drop every cached KV / prefix entry; called after every weight update."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, step=None) -> list[SampleResult]:
        """`step` is given only to an engine that yields_between_steps or stops_on_cancel, `emit`
        (a keyword: `emit=`) only to one that streams_tokens; the results are the same either way,
        but for the samples emit ends (Emit): they end at the token it saw last."""

    @abstractmethod
    def score(self, token_ids: list[int], prompt_length: int) -> tuple[list[float], torch.Tensor]:
        """Teacher-forced log-probs of token_ids[prompt_length:] and the last position's fp32 logits."""

    @abstractmethod
    def num_ranks(self) -> int: ...

    @abstractmethod
    def num_parameters(self) -> int: ...

    @abstractmethod
    def prefix_cache_entries(self) -> int: ...

    # ---- capabilities with defaults ------------------------------------------------------
    def hf_config(self) -> Any:
        """The transformers config of the served model (its family is reported in GetStatus), or None."""
        return None

    def receive_device(self) -> torch.device | None:
        """The device this process receives bus buckets on for the engine (the GPU the NCCL and CUDA
        IPC transports need), or None when unknown."""
        return None

    #: release_memory() frees the engine's GPU memory for a colocated trainer's step (SGLang with
    #: enable_memory_saver); the next in-place sync maps it again: weights in begin_apply, the rest in end_apply
    releases_memory: bool = False

    def release_memory(self) -> tuple[str, ...]:
        """Free the engine's GPU memory (its weights' contents are lost); returns the memory tags now released.
        Called with the engine gate held and no sync pending (SyncTransaction.release_memory)."""
        raise NotImplementedError(f"engine {self.name!r} cannot release its GPU memory")

    def resume_memory(self) -> None:
        """Map every released memory tag again (a no-op when none is released)."""

    def released_memory(self) -> tuple[str, ...]:
        """The memory tags released and not yet resumed (none for an engine that never releases)."""
        return ()

    def bytes_per_rank(self, sync_bytes: int) -> list[int]:
        """Bytes of the last committed sync's buckets (`sync_bytes` in all) that each rank of this engine read or
        received (CommitSyncResponse.bytes_per_rank): one rank, the whole sync, unless the engine counts itself."""
        return [sync_bytes]

    def begin_apply(self) -> None:
        """In-place sync: before its first bucket is loaded, with generation already paused by the
        engine gate. An engine that schedules requests itself pauses them here."""

    def load_bucket(self, plan: BucketPlan, buf: torch.Tensor) -> None:
        """In-place sync: load one whole flat bucket (bytes laid out as `plan` says). An engine that
        takes flat buckets as they are (SGLang's flattened-bucket update) skips the unpack."""
        self.load_weights(unpack_bucket(plan, buf))

    def end_apply(self) -> None:
        """In-place sync, at commit: after the last bucket; flushes the cache (SGLang also resumes)."""
        self.flush_cache()

    def loads_quantized(self, quantization) -> bool:
        """True: a quantized sync's block-FP8 pairs (X, X_scale_inv) are loaded as they are; False:
        X arrives dequantized to the parameter's dtype (rollout_svc/quantized.py). ValueError when
        the engine can take neither (it serves a checkpoint quantized another way)."""
        return False

    def load_bucket_summed(self, plan: BucketPlan, buf: torch.Tensor) -> int | None:
        """Load bucket `plan` (bytes in `buf`) as load_bucket does and return the checksum of the bytes the
        engine's own copy read (its checksum pass), or None, with nothing loaded, where it cannot: the
        transaction then checksums the bucket itself and calls load_bucket. For an engine whose weights
        live in other processes (SGLang's TP workers, rollout_svc/engine/sglang_direct.py)."""
        return None

    def queue_bucket_summed(self, plan: BucketPlan, buf: torch.Tensor):
        """As load_bucket_summed, for a bucket whose `buf` stays unchanged until the commit: the engine may
        write it later (with others) and returns a PendingChecksum whose `wait` writes it; None: not queued."""
        return None

    #: the engine's parameters live in another process, which shares them itself: the CUDA IPC receiver asks
    #: `ipc_destinations` for a ready-made destination table instead of `writable_params` (SGLang's TP worker,
    #: rollout_svc/engine/sglang_export.py)
    exports_destinations: bool = False

    def ipc_destinations(self, manifest):
        """(table id, weightsync.v1 IpcDestinations) of where `manifest`'s tensors lie in the engine's parameters,
        shared by the process that holds them, or None: the trainer does not write this sync (an engine that
        `exports_destinations`; weightsync/bus/ipc/trainer_writes.py). Each table id carries a fresh token."""
        return None

    def writable_params(self, metas: list[TensorMeta]) -> list[torch.Tensor] | None:
        """The parameters that tensors `metas` can be written into byte for byte, so the copy out of
        the bus buffer is also its checksum pass (weightsync/bus/copy/verified_copy.py), or None: the
        bucket then goes through load_bucket. SGLang offers views of its parameters mapped from the table its
        worker exported (rollout_svc/engine/sglang_mapped.py), only while an in-place sync holds it paused."""
        return None
