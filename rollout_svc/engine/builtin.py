"""The built-in engine: a transformers causal LM driven by our own decode loop (CPU or one GPU).

It is the embedded default of rollout-svc and the reference the SGLang adapter is held to:
real transformers modules, KV-cached decoding, per-token log-probs, a prefix cache, and
in-place weight loading by HF checkpoint names.

Naming: parameters are listed as in an HF checkpoint. With tied embeddings the checkpoint holds
only `model.embed_tokens.weight` (save_pretrained drops `lm_head.weight`), so that is the name
listed; `lm_head.weight` is still accepted by `load_weights` and lands in the same tensor.

Log-probs: a generated token's log-prob is log_softmax(logits / T) at that token, before top-k /
top-p truncation (T = 1 for greedy); `score` uses T = 1. See rollout_svc.engine.sampling.

Concurrency: the service runs concurrent requests at once, each on its thread (`batches_requests`);
they share decode steps (rollout_svc/engine/batcher.py: one worker runs every model call), each with
its own KV rows, RNG and sampling parameters, so its output does not depend on what else ran (up to
float rounding). A sliding-window model, or `batch_requests=False`, takes turns between steps
instead. Weights load only while no request is in flight (the engine gate). The engine holds
no copies of weights (parameters are updated in place), and every load drops the prefix cache, so
no KV state computed from old weights survives a load even if a caller forgets flush_cache().
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from rollout_svc.engine.base import Emit, Engine, SampleResult, SamplingParams, TokenOut
from rollout_svc.engine.batcher import DecodeBatcher, cache_is_batchable
from rollout_svc.engine.checkpoint_names import SplitParam, checkpoint_views
from rollout_svc.engine.prefix_cache import PrefixCache
from rollout_svc.engine.sampling import choose
from weightsync.bus.plan import TensorMeta

log = logging.getLogger(__name__)

# Long prompts on a large model make each entry hundreds of MB, so entries alone do not bound memory.
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


def _avoid_cudnn_attention() -> None:
    """Keep scaled_dot_product_attention off its cuDNN backend in this process.

    cuDNN attention builds an execution plan per input shape and caches it per thread. A decode
    step has a new KV length every time, and the engine decodes on threads other than the main one
    (the batcher's worker, new after each idle spell; each request's own when taking turns), so
    nearly every step built a plan: measured on GPU, each attention call took tens of times longer
    and a small model decoded several times slower (bench/bench_builtin_concurrency.py).
    The flash and memory-efficient kernels need no plan. The switch is process-wide, which is what
    a rollout process serving one engine wants."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("built-in engine: cuDNN attention off (a plan per shape and thread); flash / efficient kernels")


class _SoloDecoder:
    """Decode steps of one request on its own cache, on the caller's thread: a model whose cache
    cannot be batched (a sliding window) runs requests in turns instead (engine_gate.py)."""

    def __init__(self, model, device, cache):
        self.model, self.device, self.cache = model, device, cache

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens[:, None].to(self.device), past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1].float()

    def close(self) -> None:
        pass


class BuiltinEngine(Engine):
    name = "builtin"
    # concurrent generate calls share decode steps (batcher.py); the service gives each the cancel check
    batches_requests = True
    stops_on_cancel = True
    yields_between_steps = False
    streams_tokens = True

    def __init__(
        self,
        model,
        config,
        *,
        max_prefix_cache_entries: int = 64,
        max_prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
        batch_requests: bool = True,
    ):
        # Inference only: frozen parameters keep a stray forward outside no_grad from building a graph.
        self.model = model.eval().requires_grad_(False)
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        # checkpoint names (an MoE's experts one by one, not transformers' fused in-memory tensors)
        self._params = checkpoint_views(model)
        if self.tied and "lm_head.weight" in self._params:
            self._params.pop("lm_head.weight")
        self.prefix_cache = PrefixCache(max_prefix_cache_entries, max_prefix_cache_bytes)
        if self.device.type == "cuda":
            _avoid_cudnn_attention()
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30))
        from transformers import DynamicCache

        self._batcher: DecodeBatcher | None = None
        if batch_requests and cache_is_batchable(DynamicCache(config=config)):
            self._batcher = DecodeBatcher(lambda: self.model)
        else:
            # requests take turns between steps instead (instance attributes: the service and the gate read them)
            self.batches_requests, self.stops_on_cancel, self.yields_between_steps = False, False, True
            if batch_requests:
                log.info("built-in engine: %s keeps a sliding-window cache; requests take turns", config.model_type)
        eos = getattr(config, "eos_token_id", None)
        self.eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_prefix_cache_entries: int = 64,
        max_prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
        batch_requests: bool = True,
    ) -> "BuiltinEngine":
        """Random init from `seed`: the same (config, seed) gives the same weights on any host
        (initialised in fp32 on CPU, then cast and moved), without touching the caller's RNG."""
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(device=device, dtype=dtype)
        return cls(
            model,
            config,
            max_prefix_cache_entries=max_prefix_cache_entries,
            max_prefix_cache_bytes=max_prefix_cache_bytes,
            batch_requests=batch_requests,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_prefix_cache_entries: int = 64,
        max_prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
        batch_requests: bool = True,
    ) -> "BuiltinEngine":
        """Load a local HF directory (config + safetensors); never reaches the hub."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
        return cls(
            model,
            model.config,
            max_prefix_cache_entries=max_prefix_cache_entries,
            max_prefix_cache_bytes=max_prefix_cache_bytes,
            batch_requests=batch_requests,
        )

    # ---- weights ------------------------------------------------------------------------
    def hf_config(self):
        return self.config

    def receive_device(self) -> torch.device:
        return self.device

    def param_metas(self) -> dict[str, TensorMeta]:
        return {n: TensorMeta(n, tuple(p.shape), p.dtype) for n, p in self._params.items()}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) for every weight: the parameter itself, or a copy of the part
        of a fused parameter a checkpoint tensor is (MoE experts)."""
        for n, p in self._params.items():
            yield n, (p.value() if isinstance(p, SplitParam) else p)

    def _target(self, name: str):
        if self.tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        return self._params.get(name)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a (partial) set of HF-named tensors into the parameters in place, cast to the
        engine's dtype and device. The whole batch is validated first: a bad tensor changes nothing."""
        items = list(named)
        for name, t in items:
            p = self._target(name)
            if p is None:
                raise ValueError(
                    f"tensor {name}: not a parameter of this {self.config.model_type} model "
                    f"(see param_metas() for the accepted HF names)"
                )
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tensor {name}: got {type(t).__name__}, expected a torch.Tensor")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"tensor {name}: shape {list(t.shape)} != expected {list(p.shape)}")
            if t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be cast to {p.dtype}")
        # Any cached KV was computed from the old weights: drop it now, not only at flush_cache().
        self.prefix_cache.flush()
        with torch.no_grad():
            for name, t in items:
                self._target(name).copy_(t, non_blocking=False)

    def writable_params(self, metas) -> list[torch.Tensor] | None:
        """The parameters that tensors `metas` (name, shape, dtype) load into, when each already is
        exactly that tensor's layout (same shape and dtype, contiguous), so that a caller can write
        the received bytes straight in (rollout_svc/sync/transaction.py); None when any is not, and
        load_weights must cast. The caller writes now: the cached KV is dropped, as load_weights does."""
        out = []
        for m in metas:
            p = self._target(m.name)
            # a tensor that lives inside a fused parameter (checkpoint_names.SplitParam: MoE experts) is
            # not its own storage: it loads through load_weights
            if not isinstance(p, torch.Tensor):
                return None
            if tuple(p.shape) != tuple(m.shape) or p.dtype != m.dtype or not p.is_contiguous():
                return None
            out.append(p.data)
        self.prefix_cache.flush()
        return out

    def flush_cache(self) -> None:
        self.prefix_cache.flush()

    def prefix_cache_entries(self) -> int:
        return len(self.prefix_cache)

    def num_ranks(self) -> int:
        return 1

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._params.values())

    # ---- inference ----------------------------------------------------------------------
    def _check_ids(self, ids: list[int], what: str, extra: int = 0) -> None:
        if not ids:
            raise ValueError(f"{what}: empty token list")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) + extra > self.max_positions:
            raise ValueError(
                f"{what}: {len(ids)} tokens + max_new_tokens {extra} exceed max_position_embeddings "
                f"{self.max_positions}"
            )

    @torch.no_grad()
    def _prefill(self, prompt: list[int]) -> tuple[object, torch.Tensor, bool]:
        from transformers import DynamicCache

        epoch = self.prefix_cache.epoch  # read before the prefill: a flush during it voids the result
        hit = self.prefix_cache.get(prompt)
        if hit is not None:
            return hit.cache, hit.last_logits, True
        cache = DynamicCache(config=self.config)
        out = self.model(torch.tensor([prompt], device=self.device), past_key_values=cache, use_cache=True)
        last = out.logits[:, -1].float()
        self.prefix_cache.put(prompt, out.past_key_values, last, epoch=epoch)
        return out.past_key_values, last, False

    def _model_call(self, fn):
        """Run a model call where this engine runs them: on the batcher's worker, or here (not batching)."""
        return self._batcher.call(fn) if self._batcher is not None else fn()

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, step=None, emit: Emit | None = None
    ) -> list[SampleResult]:
        """`step()`, if given, runs before each prefill and decode step; raising there stops the
        request (its client went away) and frees its rows within one step. `emit`, if given, gets
        each step's sampled tokens before the next step runs, and the samples it returns end there (base.Emit).
        Concurrent calls share decode steps (rollout_svc/engine/batcher.py)."""
        sampling.validate()
        for i, p in enumerate(prompts):
            self._check_ids(p, f"prompts[{i}]", sampling.max_new_tokens)
        results: list[SampleResult] = []
        for pi, prompt in enumerate(prompts):
            if step is not None:
                step()
            cache, last, hit = self._model_call(lambda prompt=prompt: self._prefill(prompt))
            if sampling.n > 1:
                cache.batch_repeat_interleave(sampling.n)
            decoder = self._decoder(cache, sampling.n, len(prompt))
            try:
                toks, lps, reason = self._decode(pi, last, decoder, sampling, step, emit)
            finally:
                decoder.close()
            results += [SampleResult(pi, toks[r], lps[r], reason[r], hit) for r in range(sampling.n)]
        return results

    def _decoder(self, cache, n: int, position: int):
        if self._batcher is not None:
            return self._batcher.join(cache, n, position)
        return _SoloDecoder(self.model, self.device, cache)

    def _decode(self, pi: int, last: torch.Tensor, decoder, sampling: SamplingParams, step, emit):
        n = sampling.n
        stops = set(sampling.stop_token_ids) | set(self.eos_ids)
        logits = last.expand(n, -1)
        gen = torch.Generator().manual_seed((sampling.seed * 1_000_003 + pi) & ((1 << 63) - 1))
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        reason = ["length"] * n
        for k in range(sampling.max_new_tokens):
            tok, lp = choose(logits, sampling, gen)
            # one conversion per step, not two tensor indexings per sample (n = 64: ~0.3 ms a step)
            emitted = []
            for r, (t, p) in enumerate(zip(tok.tolist(), lp.tolist())):
                if done[r]:
                    continue
                toks[r].append(t)
                lps[r].append(p)
                if t in stops:
                    done[r], reason[r] = True, "stop"
                if emit is not None:
                    last = done[r] or len(toks[r]) == sampling.max_new_tokens
                    emitted.append(TokenOut(r, t, p, reason[r] if last else None))
            if emitted:
                for r in emit(pi, emitted) or ():  # a stop string completed: decode no more of it
                    if not done[r]:
                        done[r], reason[r] = True, "stop"
            if all(done) or k == sampling.max_new_tokens - 1:
                break  # the last token needs no forward: nothing samples from its logits
            if step is not None:
                step()
            logits = decoder.step(tok)
        return toks, lps, reason

    @torch.no_grad()
    def score(self, token_ids: list[int], prompt_length: int) -> tuple[list[float], torch.Tensor]:
        self._check_ids(token_ids, "token_ids")
        if not 0 < prompt_length <= len(token_ids):
            raise ValueError(f"prompt_length={prompt_length} must be in [1, {len(token_ids)}]")
        logits = self._model_call(lambda: self.model(torch.tensor([token_ids], device=self.device)).logits[0].float())
        logp = torch.log_softmax(logits[:-1], -1)
        targets = torch.tensor(token_ids[1:], device=self.device)
        per_tok = logp.gather(-1, targets[:, None]).squeeze(-1)[prompt_length - 1 :]
        return per_tok.cpu().tolist(), logits[-1].cpu()
