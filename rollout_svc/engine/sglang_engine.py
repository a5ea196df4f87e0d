"""SglangEngine: rollout-svc's Engine (engine/base.py) on an in-process SGLang `Engine` (`--engine sglang`).

Lifecycle and generation live here; token streaming (`generate(emit=)`) in `sglang_stream`; the
weight-update paths in `sglang_weights` (read its docstring for the three paths, the NCCL rendezvous
mismatch and what the trainer must serve).
Everything this adapter calls in SGLang is declared in `sglang_api.SGLANG_API_USED` and checked
against the real sglang wheels by tests/unit/rollout_svc/engine/sglang; SGLang's own CPU Engine runs behind
the adapter in the opt-in tests/sglang_exec/test_sglang_engine_cpu.py (it cannot run on the lent
GPU hosts; see docs/sglang.md).

Threading: SGLang batches concurrent requests itself (continuous batching), so generation calls from many
threads run at once (`batches_requests`: the engine gate lets every pinned request in, no turns). SGLang's
sync `Engine` methods each run `loop.run_until_complete` on the Engine's one asyncio loop, which two
threads cannot do at once; `sglang_loop.LoopThread` replaces `Engine.loop` with that loop run forever on a
thread of its own, each call's coroutine handed to it (read its docstring for why this is correct on
0.5.10 and 0.5.23). Every SGLang call, generation and weight update alike, goes through it; weight
updates never overlap generation because the engine gate holds a sync until no request holds a version
pin (rollout_svc/sync/engine_gate.py). Aborts are queued on the loop (`_abort`), never run from another thread.

sglang is imported only inside functions: a builtin-engine pod never needs it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rollout_svc.engine.base import Emit, Engine, SampleResult, SamplingParams
from rollout_svc.engine.sglang_direct import SglangDirectMixin
from rollout_svc.engine.sglang_export import SglangExportMixin
from rollout_svc.engine.sglang_loop import LoopThread
from rollout_svc.engine.sglang_mapped import SglangMappedMixin
from rollout_svc.engine.sglang_options import check_options, server_arg_names
from rollout_svc.engine.sglang_shards import SglangShardsMixin
from rollout_svc.engine.sglang_stream import SglangStreamMixin, finish_kind
from rollout_svc.engine.sglang_weights import SglangWeightsMixin, check_result
from weightsync.bus.plan import TensorMeta
from weightsync.bus.workers import Workers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SglangOptions:
    """Engine settings; `from_rollout_config` builds them from the rollout config's inference section
    (`model`, `tp`, `dtype`, `device` and the `sglang` options)."""

    model_path: str
    tp_size: int = 1
    dtype: str = "bfloat16"  # SGLang's --dtype: auto | bfloat16 | float16 | float32
    mem_fraction_static: float | None = None  # share of GPU memory for weights + KV cache (None: SGLang picks)
    base_gpu_id: int = 0  # first GPU of this engine's TP group
    random_seed: int | None = None
    colocated: bool = False  # enable_memory_saver, so release/resume_memory work
    # SGLang honours a per-request sampling_seed only with enable_deterministic_inference
    # (sampling_batch_info.from_schedule_batch); without it our `seed` is ignored.
    deterministic: bool = False
    context_length: int | None = None
    disable_radix_cache: bool = False
    trust_remote_code: bool = False
    log_level: str = "error"
    #: register our loader in SGLang's workers (sglang_loader.py) and send CUDA buckets through it
    direct_loader: bool = True
    #: tp_size > 1: every TP rank opens the bucket on its own GPU and reads only its shards across the link
    #: (sglang_peer.py), where SGLang would move the whole bucket onto the rank's GPU first
    peer_reads: bool = True
    #: tp_size 1 without the memory saver: once SGLang's worker exported a layout's table (sglang_export.py),
    #: rollout-svc maps SGLang's parameters and writes NCCL/TCP buckets into them itself (sglang_mapped.py)
    rollout_writes: bool = True
    #: the TP rank whose GPU rollout-svc receives buckets on (the rollout config's `receive_rank`)
    receive_rank: int = 0
    #: every other ServerArgs field the rollout config sets (`inference.sglang`), as (name, value) pairs
    extra: tuple[tuple[str, Any], ...] = ()

    def validate(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"sglang tp_size={self.tp_size} must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"sglang mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"sglang dtype={self.dtype!r} must be auto, bfloat16, float16 or float32")


def _sampling_params_dict(s: SamplingParams, seed: int | None) -> dict:
    """Our SamplingParams as SGLang's sampling_params keys (one request, n=1)."""
    d = dict(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        stop_token_ids=list(s.stop_token_ids),
        n=1,
    )
    if s.top_k > 0:  # ours: 0 = off; SGLang's default already means "all"
        d.update(top_k=s.top_k)
    if seed is not None:
        d.update(sampling_seed=seed)
    return d


def _to_sample(prompt_index: int, out: dict) -> SampleResult:
    meta = out["meta_info"]
    kind = finish_kind(meta) or "length"
    if kind == "abort":
        raise RuntimeError(f"sglang aborted the request for prompt {prompt_index}: {meta.get('finish_reason')}")
    # output_token_logprobs: [(logprob, token_id, text_or_None), ...]
    lps = [float(row[0]) for row in meta.get("output_token_logprobs") or []]
    return SampleResult(
        prompt_index=prompt_index,
        token_ids=list(out["output_ids"]),
        logprobs=lps,
        finish_reason="stop" if kind == "stop" else "length",
        # tokens of the prompt served from SGLang's radix cache: what the service counts as a prefix hit
        prefix_cache_hit=int(meta.get("cached_tokens") or 0) > 0,
    )


def _hf_param_metas(config: Any, dtype: torch.dtype) -> dict[str, TensorMeta]:
    """Names and full shapes of the HF model's parameters, from the config alone (meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters() lists a tied lm_head once (as the embedding), as the trainer exports it.
    metas: dict[str, TensorMeta] = {}
    for n, p in model.named_parameters():
        for name, shape in _checkpoint_names(n, tuple(p.shape)):
            metas[name] = TensorMeta(name, shape, dtype)
    return metas


def _checkpoint_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors behind one transformers parameter: SGLang's `load_weights` takes
    checkpoint names, and transformers 5 fuses MoE experts into `mlp.experts.gate_up_proj`
    [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I]. SGLang's MoE models skip
    the fused names without an error (the experts would silently keep their old weights), so the
    manifest must carry per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (as the Megatron
    trainer exports them). Found by tests/sglang_exec."""
    if name.endswith("mlp.experts.gate_up_proj") and len(shape) == 3:
        pre, (e, two_i, h) = name[: -len("gate_up_proj")], shape
        return [(f"{pre}{x}.{w}_proj.weight", (two_i // 2, h)) for x in range(e) for w in ("gate", "up")]
    if name.endswith("mlp.experts.down_proj") and len(shape) == 3:
        pre, (e, h, i) = name[: -len("down_proj")], shape
        return [(f"{pre}{x}.down_proj.weight", (h, i)) for x in range(e)]
    return [(name, shape)]


#: Variables SGLang's `Engine()` sets in the process that builds it (`_set_envs_and_config`, 0.5.10 and
#: 0.5.23: NCCL_CUMEM_ENABLE=0 unless already set) for its own NCCL ranks, and that must not leak into
#: rollout-svc's own NCCL transport, which runs in this process: NCCL peers must agree on cuMem, and the
#: trainer keeps NCCL's default, so a rollout that inherited SGLang's 0 failed ncclCommInitRank with
#: "unhandled cuda error" (seen on two H100s, bench/sglang_live.py). Restored once the Engine has started.
HOST_ENV_RESTORED = ("NCCL_CUMEM_ENABLE",)
#: begin_apply's radix cache flushes run here (threads kept across syncs: none started per sync)
_FLUSHES = Workers("sglang-flush")
#: longest end_apply waits for that flush (a scheduler round trip: milliseconds)
FLUSH_TIMEOUT_S = 60.0


class _EarlyFlush:
    """begin_apply's flush of SGLang's radix cache, on a kept thread while the buckets arrive; end_apply waits."""

    def __init__(self, engine):
        self.exc: BaseException | None = None
        self.job = _FLUSHES.submit(lambda: self._run(engine))

    def _run(self, engine) -> None:
        t0 = time.perf_counter()
        try:
            engine.flush_cache()
        except BaseException as exc:  # noqa: BLE001 — handed to wait(), which fails the sync with it
            self.exc = exc
        engine._add_ms("flush_cache", (time.perf_counter() - t0) * 1e3)

    def wait(self) -> None:
        self.job.join(FLUSH_TIMEOUT_S)
        if self.job.is_alive():
            raise TimeoutError(f"SGLang's flush_cache did not answer in {FLUSH_TIMEOUT_S:.0f} s")
        if self.exc is not None:
            raise self.exc


def drive_loop(sgl) -> LoopThread:
    """Run SGLang Engine `sgl`'s asyncio loop forever on a thread of its own and make it `sgl.loop`, so that
    SGLang's sync methods can be called from many threads at once (sglang_loop.py)."""
    if not isinstance(sgl.loop, LoopThread):
        sgl.loop = LoopThread(sgl.loop)
    return sgl.loop


class SglangEngine(
    SglangStreamMixin,
    SglangDirectMixin,
    SglangShardsMixin,
    SglangMappedMixin,
    SglangExportMixin,
    SglangWeightsMixin,
    Engine,
):
    name = "sglang"

    def __init__(self, opts: SglangOptions, metas: dict[str, TensorMeta], hf_config: Any = None):
        opts.validate()
        self.opts = opts
        self._hf_config = hf_config
        self.tp_size = opts.tp_size
        self._metas = metas
        self._update_group = ""
        self._sgl = self._start(opts)
        drive_loop(self._sgl)

    @staticmethod
    def _start(o: SglangOptions):
        from sglang.srt.entrypoints.engine import Engine

        from rollout_svc.engine.sglang_loader import LOADER

        kept = {k: os.environ.get(k) for k in HOST_ENV_RESTORED}
        extra = dict(o.extra)
        loaders = list(extra.pop("custom_weight_loader", None) or [])
        if o.direct_loader and LOADER not in loaders:
            loaders.append(LOADER)
        try:
            # skip_tokenizer_init: prompts and outputs are token ids; no detokenisation cost.
            return Engine(
                model_path=o.model_path,
                tp_size=o.tp_size,
                dtype=o.dtype,
                mem_fraction_static=o.mem_fraction_static,
                base_gpu_id=o.base_gpu_id,
                random_seed=o.random_seed,
                enable_memory_saver=o.colocated,
                context_length=o.context_length,
                disable_radix_cache=o.disable_radix_cache,
                trust_remote_code=o.trust_remote_code,
                enable_deterministic_inference=o.deterministic,
                skip_tokenizer_init=True,
                # streamed items hold every token so far, in both versions (sglang_stream.py)
                incremental_streaming_output=False,
                log_level=o.log_level,
                # functions SGLang's TP workers may run as a load_format (ours: sglang_loader.load)
                custom_weight_loader=loaders or None,
                **extra,
            )
        finally:
            # SGLang's schedulers were spawned with SGLang's values; this process keeps its own
            for k, v in kept.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    @classmethod
    def from_rollout_config(cls, cfg) -> SglangEngine:
        """`cfg`: the rollout config's `inference` section."""
        from rollout_svc.engine.sglang_fp8 import check_block_aligned, served_metas
        from weightsync.bus.dtypes import parse_dtype
        from weightsync.debug import switches
        from weightsync.models import resolve_model

        config, weights_dir = resolve_model(cfg.model)
        if not weights_dir:
            raise ValueError(
                f"model={cfg.model!r}: engine=sglang needs an HF model directory with weights "
                "(built-in tiny configs exist only for the builtin engine)"
            )
        device = str(getattr(cfg, "device", "cuda:0"))
        gpu = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0

        args = dict(cfg.sglang)
        if args:
            version, known = server_arg_names()
            check_options(args, known, version)
        # the options this adapter also reads (seeds, memory release) travel as named settings
        opts = SglangOptions(
            model_path=weights_dir,
            tp_size=cfg.tp,
            receive_rank=int(getattr(cfg, "receive_rank", 0)),
            dtype=cfg.dtype,
            base_gpu_id=gpu,
            random_seed=args.pop("random_seed", cfg.init_seed),
            mem_fraction_static=args.pop("mem_fraction_static", None),
            colocated=bool(args.pop("enable_memory_saver", False)),
            context_length=args.pop("context_length", None),
            disable_radix_cache=bool(args.pop("disable_radix_cache", False)),
            trust_remote_code=bool(args.pop("trust_remote_code", False)),
            deterministic=bool(args.pop("enable_deterministic_inference", False)),
            log_level=args.pop("log_level", "error"),
            # the debug section's (docs/operations.md "Debug switches"): the old hand-overs, for an A/B on a GPU
            peer_reads=switches().sglang_peer_reads,
            rollout_writes=switches().sglang_rollout_writes,
            extra=tuple(sorted(args.items())),
        )
        # a block-FP8 checkpoint: its linear weights are float8_e4m3fn in SGLang (sglang_fp8.py), checked for block
        # alignment here, before SGLang starts, so the error names the tensor and the fix
        metas = served_metas(_hf_param_metas(config, parse_dtype(cfg.dtype)), config)
        check_block_aligned(metas, config, cfg.tp)
        return cls(opts, metas, hf_config=config)

    @property
    def releases_memory(self) -> bool:
        # SGLang's release/resume_memory_occupation need torch_memory_saver's regions (enable_memory_saver)
        return bool(self.opts.colocated)

    def _call(self, fn, *args, **kwargs):
        # no lock: fn runs its coroutine on SGLang's loop thread (drive_loop), from any number of threads at once
        return fn(*args, **kwargs)

    # ---- Engine ----------------------------------------------------------------
    def hf_config(self) -> Any:
        return self._hf_config

    def receive_device(self) -> torch.device:
        # SGLang runs in this process's CUDA context from its first TP rank's GPU, where buckets are
        # handed over with load_bucket; `receive_rank` > 0 moves that to another rank's GPU (NCCL takes no two
        # ranks on one GPU: a trainer sharing the first GPU syncs over nccl into another); every rank reads its
        # shards from there (sglang_peer.py)
        return torch.device("cuda", int(self.opts.base_gpu_id) + int(self.opts.receive_rank))

    def param_metas(self) -> dict[str, TensorMeta]:
        return dict(self._metas)

    def loads_quantized(self, quantization) -> bool:
        """Block FP8 syncs go to SGLang's FP8 loader as they are (`X` e4m3 + `X_scale_inv`) when it
        serves a block-FP8 checkpoint; for a 16-bit checkpoint the rollout dequantizes first."""
        from rollout_svc.quantized import serves_same_quantization

        return serves_same_quantization(self._hf_config, quantization)

    def num_ranks(self) -> int:
        return self.tp_size

    def num_parameters(self) -> int:
        return sum(math.prod(m.shape) for m in self._metas.values())

    def prefix_cache_entries(self) -> int:
        return 0  # SGLang's radix cache size is not exposed through the Engine API

    def flush_cache(self) -> None:
        res = self._call(self._sgl.flush_cache)
        check_result(res, "flush_cache")

    #: `generate(step=)` is asked every CANCEL_POLL_S while SGLang runs the request, and a `step` that
    #: raises aborts the request in SGLang's scheduler (rollout_svc.service). SGLang batches requests
    #: itself: there are no turns to hand over between steps, so `yields_between_steps` stays off.
    stops_on_cancel = True
    #: concurrent generate calls (each on its own thread) run at once in SGLang's scheduler (drive_loop)
    batches_requests = True
    #: `generate(emit=)` runs the request through SGLang's streaming generate and hands each token to
    #: `emit` as SGLang makes it (sglang_stream.py); a sample emit ends (a stop string, base.Emit) is
    #: aborted in SGLang at that token. Without `emit` (gRPC Generate, a request with no stop strings
    #: and no `stream`) it is one non-streaming batched call, as before.
    streams_tokens = True
    CANCEL_POLL_S = 0.05

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, step=None, emit: Emit | None = None
    ) -> list[SampleResult]:
        sampling.validate()
        # One request per (prompt, sample), prompt-major, so each sample can get its own seed
        # (SGLang's n>1 would give a prompt's samples one shared seed); the radix cache still
        # shares the prompt's prefill between them.
        ids, params, owner = [], [], []
        for i, p in enumerate(prompts):
            for _ in range(sampling.n):
                seed = sampling.seed + len(ids) if self.opts.deterministic else None
                ids.append(list(p))
                params.append(_sampling_params_dict(sampling, seed))
                owner.append(i)
        if emit is not None:
            return self._generate_streamed(ids, params, owner, sampling.n, emit, step)
        outs = self._generate(ids, params, step)
        if len(outs) != len(ids):
            raise RuntimeError(f"sglang returned {len(outs)} outputs for {len(ids)} requests")
        return [_to_sample(owner[k], o) for k, o in enumerate(outs)]

    def _generate(self, ids, params, step) -> list[dict]:
        """Engine.generate, one request id per request, its outputs once all are done; with `step`, a
        cancellation aborts them (_aborting_on_cancel), the call returns, and `step`'s exception is raised here."""
        rids = [uuid.uuid4().hex for _ in ids]
        with self._aborting_on_cancel(rids, step) as stopped:
            try:
                outs = self._call(
                    self._sgl.generate, input_ids=ids, sampling_params=params, return_logprob=True, rid=rids
                )
            except Exception:
                if not stopped:
                    raise
                outs = None  # SGLang may answer an aborted request with an error: the cancellation wins
        if stopped:
            raise stopped[0]
        return outs

    def _abort(self, rids: list[str]) -> None:
        """Abort SGLang requests (their KV cache freed, the batch slot given back). On SGLang's own loop:
        abort_request writes to the scheduler's ZMQ socket, which belongs to the thread running that loop
        (sglang_loop.LoopThread: queued now, it runs there next, whatever other calls are waiting). All in
        one callback, so that SGLang's loop decodes nothing more for the rest once the first is aborted."""
        tm = self._sgl.tokenizer_manager

        def abort_all():
            for rid in rids:
                tm.abort_request(rid)

        self._sgl.loop.call_soon_threadsafe(abort_all)

    @contextmanager
    def _aborting_on_cancel(self, rids: list[str], step) -> Iterator[list[BaseException]]:
        """While the block runs, a watcher asks `step` (None: nothing to ask) every CANCEL_POLL_S; once it
        raises, requests `rids` are aborted. Yields a list that then holds step's exception."""
        stopped: list[BaseException] = []
        if step is None:
            yield stopped
            return
        done = threading.Event()

        def watch():
            while not done.wait(self.CANCEL_POLL_S):
                try:
                    step()
                except BaseException as exc:  # noqa: BLE001 — handed to the caller
                    stopped.append(exc)
                    self._abort(rids)
                    return

        watcher = threading.Thread(target=watch, name="sglang-cancel-watch", daemon=True)
        watcher.start()
        try:
            yield stopped
        finally:
            done.set()
            watcher.join(timeout=5)

    def score(self, token_ids: list[int], prompt_length: int) -> tuple[list[float], torch.Tensor]:
        """Teacher-forced log-probs via SGLang's input-token log-probs.

        SGLang's Engine API does not return logits, so the second element is an empty tensor.
        """
        if not 0 < prompt_length <= len(token_ids):
            raise ValueError(f"prompt_length={prompt_length} must be in [1, {len(token_ids)}]")
        s = SamplingParams(max_new_tokens=1, temperature=0.0)
        # SGLang's input_token_logprobs start AT token logprob_start_len and that first row has no
        # log-prob (None); so start one token early to get token_ids[prompt_length:]. (Measured on
        # SGLang 0.5.23's CPU engine, tests/sglang_exec/engine_e2e.py; asking for prompt_length came back
        # one short.)
        out = self._call(
            self._sgl.generate,
            input_ids=list(token_ids),
            sampling_params=_sampling_params_dict(s, None),
            return_logprob=True,
            logprob_start_len=prompt_length - 1,
        )
        rows = out["meta_info"]["input_token_logprobs"]
        lps = [float(r[0]) for r in rows if r[0] is not None]
        want = len(token_ids) - prompt_length
        if len(lps) != want:
            raise RuntimeError(f"sglang returned {len(lps)} input log-probs, expected {want}")
        return lps, torch.empty(0)

    # ---- around an in-place sync (Engine's begin_apply / end_apply; docs/sglang.md) -------
    def begin_apply(self) -> None:
        """Before the first bucket of a sync: stop the scheduler, open SGLang's update session."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self.drop_queued()  # buckets an aborted sync queued are never written
        self.apply_ms = {}
        self.sync_layouts = {}  # this sync's buckets our loader wrote: bucket index -> layout (sglang_export.py)
        self.rank_bytes = None  # counted by our loader's calls (sglang_direct.py)
        # SGLang's Engine has no pause wrapper (0.5.10, 0.5.23): drive the tokenizer manager's.
        if hasattr(self._sgl.tokenizer_manager, "pause_generation"):
            with self.timed("pause"):
                self._call(
                    self._sgl.loop.run_until_complete,
                    self._sgl.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode="in_place")),
                )
        # The radix cache is flushed now, while the buckets arrive, not after the last one: paused, SGLang
        # schedules no forward, so nothing enters the cache before continue; SGLang's flush (a scheduler round
        # trip, 1.2-2 ms on an H200) was the gap between a sync into SGLang and one into the built-in engine.
        # With memory released (colocated RL) its pools are not mapped: the flush waits for end_apply's resume.
        self._flush = None if self.released_memory() else _EarlyFlush(self)
        # released for a colocated train step: the weights must be mapped again before a byte is written
        # (their virtual addresses are kept, so our loader's slot table stays valid); the KV cache waits for
        # end_apply, so it is not resident while the trainer's buckets are
        self.resume_memory(["weights"])
        if hasattr(self._sgl, "begin_weight_update"):
            check_result(self._call(self._sgl.begin_weight_update), "begin_weight_update")
        self._paused_at = time.perf_counter()
        self.writing_in_place = True  # SGLang paused: rollout-svc may write its mapped parameters (sglang_mapped.py)

    def end_apply(self) -> None:
        """After the last bucket: close the session, flush the KV/radix cache, resume scheduling."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self.writing_in_place = False  # every write of this sync was checked before the commit got here
        # paused, until the commit: the buckets' stream (or the trainer's writes) and the commit's arrival
        self._add_ms("paused_to_commit", (time.perf_counter() - getattr(self, "_paused_at", time.perf_counter())) * 1e3)
        self.flush_queued()  # any bucket queued and not yet written (sglang_direct.py)
        self.export_after_sync()  # once per layout: where the trainer may write later syncs (sglang_export.py)
        if hasattr(self._sgl, "end_weight_update"):
            check_result(self._call(self._sgl.end_weight_update), "end_weight_update")
        self.resume_memory()  # what a colocated train step released besides the weights (KV cache, CUDA graphs)
        flush, self._flush = getattr(self, "_flush", None), None
        if flush is None:
            with self.timed("flush_cache"):
                self.flush_cache()
        else:
            with self.timed("flush_wait"):  # begin_apply's flush; its error (a busy scheduler) fails the sync
                flush.wait()
        if hasattr(self._sgl.tokenizer_manager, "continue_generation"):
            with self.timed("continue"):
                self._call(
                    self._sgl.loop.run_until_complete,
                    self._sgl.tokenizer_manager.continue_generation(ContinueGenerationReqInput()),
                )
        # where a sync's time goes in SGLang (bench/sglang_live.py records these lines)
        log.warning("sglang apply timings (ms): %s", {k: round(v, 2) for k, v in self.apply_ms.items()})

    def close(self) -> None:
        try:
            self.leave_update_group()
            self.close_export()
        finally:
            try:
                self._call(self._sgl.shutdown)
            finally:
                loop = getattr(self._sgl, "loop", None)
                if isinstance(loop, LoopThread):
                    loop.stop()
