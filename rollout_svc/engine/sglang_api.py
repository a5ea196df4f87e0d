"""Every piece of SGLang's API that the SGLang adapter touches, as data.

The adapter (`sglang_engine`, `sglang_weights`) may use a SGLang class, method, keyword, request
field or output key only if it is listed here. `tests/unit/rollout_svc/engine/sglang` checks this table
against the real sglang wheels (parsed with `ast`, never imported) and checks that the adapter
uses nothing outside it. This module imports nothing heavy: it is safe on any pod.

Facts behind the entries were read from the sglang wheels named in `CHECKED_VERSIONS`
(see docs/sglang.md for paths and the compatibility matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

# pip requirement for the rollout image; see docs/sglang.md "Pinned range" for why.
SGLANG_REQUIREMENT = "sglang>=0.5.10,<0.6"
# The wheels the contract test downloads and checks (oldest and newest of the range we read).
CHECKED_VERSIONS = ("0.5.10", "0.5.23")


@dataclass(frozen=True)
class ApiUse:
    """One thing the adapter relies on.

    kind:
      "class"   — `module.cls` is a class defined at the top level of `module`.
      "attribute" — instances of `module.cls` get attribute `name` (`self.name = ...` in a method).
      "method"  — `module.cls.name` is a (sync or async) method, on the class or a base class;
                  `params` must all be accepted (by name, or by **kwargs).
      "fields"  — `module.cls` declares every name in `params` as a class-level (dataclass /
                  msgspec / annotated) field.
      "server_args" — every name in `params` is a ServerArgs field (`module.cls`, or, from
                  0.5.2x on, one of the field namespaces under sglang/srt/arg_groups/fields/).
      "attribute_uses" — `module.cls`'s own methods read `self.name` only as `self.name.<p>` for a `p` in
                  `params` (assigning it is free): what the adapter may replace that attribute with.
      "function" — `module.name` is a top-level function.
      "unpickle" — `module.cls` is SGLang's SafeUnpickler; each "mod:name" in `params` passes its
                  allow-list (exact pairs or module prefixes, whichever the version has).
      "literal" — each string in `params` occurs as a string constant in some file of the package
                  (or module) `module` (output dict
                  keys and magic values that have no declaration to check).
    optional: the adapter feature-detects it at run time (`hasattr`); the test reports it
      per version instead of failing when it is absent.
    """

    kind: str
    module: str
    cls: str
    name: str = ""
    params: tuple[str, ...] = ()
    optional: bool = False
    why: str = ""


_ENGINE = "sglang.srt.entrypoints.engine"
_IO = "sglang.srt.managers.io_struct"
_TM = "sglang.srt.managers.tokenizer_manager"

SGLANG_API_USED: dict[str, ApiUse] = {
    # ---- lifecycle ---------------------------------------------------------------------
    "Engine": ApiUse(
        "class",
        _ENGINE,
        "Engine",
        why="in-process engine (tokenizer manager here, scheduler per TP rank in subprocesses)",
    ),
    "ServerArgs": ApiUse(
        "server_args",
        "sglang.srt.server_args",
        "ServerArgs",
        params=(
            "model_path",
            "tp_size",
            "dtype",
            "mem_fraction_static",
            "random_seed",
            "skip_tokenizer_init",
            "enable_memory_saver",
            "base_gpu_id",
            "log_level",
            "trust_remote_code",
            "context_length",
            "disable_radix_cache",
            "enable_deterministic_inference",
            "incremental_streaming_output",
            "custom_weight_loader",
        ),
        why="Engine(**kwargs) builds ServerArgs(**kwargs); custom_weight_loader: update_weights_from_tensor runs "
        "dynamic_import(load_format)(model, named_tensors) in each TP worker when load_format is listed there (0.5.10 "
        "ModelRunner, 0.5.23 WeightUpdater; executed in tests/sglang_exec); incremental_streaming_output=False "
        "(its default in 0.5.10 and 0.5.23) keeps streamed items cumulative",
    ),
    "Engine.shutdown": ApiUse("method", _ENGINE, "Engine", "shutdown"),
    "Engine.loop": ApiUse(
        "attribute",
        _ENGINE,
        "Engine",
        "loop",
        why="the asyncio loop Engine's own sync wrappers (and generate(stream=True)'s generator) run on; the adapter "
        "replaces it with sglang_loop.LoopThread (the same loop run forever on its own thread), queues aborts on it "
        "and drives pause/continue through it",
    ),
    "Engine.loop uses": ApiUse(
        "attribute_uses",
        _ENGINE,
        "Engine",
        "loop",
        params=("run_until_complete",),
        why="every Engine method reaches its loop only as self.loop.run_until_complete(coroutine), so a LoopThread "
        "(whose run_until_complete hands the coroutine to the loop's thread) may stand in for it: what lets several "
        "threads call Engine at once (sglang_loop.py)",
    ),
    "Engine.tokenizer_manager": ApiUse("attribute", _ENGINE, "Engine", "tokenizer_manager"),
    # ---- generation --------------------------------------------------------------------
    "Engine.generate": ApiUse(
        "method",
        _ENGINE,
        "Engine",
        "generate",
        params=("input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid", "stream"),
        why="stream=True: a sync generator running Engine.loop per item; each item one request's output so far "
        "(meta_info id = its rid), cumulative while incremental_streaming_output is off",
    ),
    "SamplingParams": ApiUse(
        "fields",
        "sglang.srt.sampling.sampling_params",
        "SamplingParams",
        params=("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "n", "sampling_seed"),
        why="keys of the sampling_params dict passed to Engine.generate",
    ),
    "GenerateReqInput": ApiUse(
        "fields",
        _IO,
        "GenerateReqInput",
        params=("input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid", "stream"),
    ),
    "TokenizerManager.abort_request": ApiUse(
        "method",
        _TM,
        "TokenizerManager",
        "abort_request",
        params=("rid",),
        why="a cancelled Generate aborts its requests, a stop string its sample's request (called on Engine.loop: "
        "it writes the scheduler's ZMQ socket); an aborted streamed request ends with finish_reason type 'abort'",
    ),
    "generate output keys": ApiUse(
        "literal",
        "sglang.srt.managers",
        "",
        params=(
            "output_ids",
            "meta_info",
            "finish_reason",
            "output_token_logprobs",
            "input_token_logprobs",
            "type",
            "cached_tokens",
            "id",
        ),
        why="id: meta_info['id'] of a streamed item, the rid of the request it belongs to",
    ),
    # ---- cache and scheduling around a sync --------------------------------------------
    "Engine.flush_cache": ApiUse("method", _ENGINE, "Engine", "flush_cache"),
    "FlushCacheReqOutput": ApiUse(
        "fields",
        _IO,
        "FlushCacheReqOutput",
        params=("success",),
        why="flush_cache's return; update_* return (success, message) tuples",
    ),
    "TokenizerManager.pause_generation": ApiUse(
        "method",
        _TM,
        "TokenizerManager",
        "pause_generation",
        params=("obj",),
        optional=True,
        why="Engine has no pause wrapper in 0.5.10 or 0.5.23; reached via engine.tokenizer_manager",
    ),
    "TokenizerManager.continue_generation": ApiUse(
        "method", _TM, "TokenizerManager", "continue_generation", params=("obj",), optional=True
    ),
    "PauseGenerationReqInput": ApiUse("fields", _IO, "PauseGenerationReqInput", params=("mode",)),
    "pause mode in_place": ApiUse(
        "literal",
        _IO,
        "",
        params=("in_place",),
        why="keep requests in the scheduler (none run: a sync waits for every request's version pin)",
    ),
    "ContinueGenerationReqInput": ApiUse("class", _IO, "ContinueGenerationReqInput"),
    # ---- weight update: distributed (SGLang receives the NCCL broadcast itself) ----------
    "Engine.init_weights_update_group": ApiUse(
        "method",
        _ENGINE,
        "Engine",
        "init_weights_update_group",
        params=("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    ),
    "Engine.destroy_weights_update_group": ApiUse(
        "method", _ENGINE, "Engine", "destroy_weights_update_group", params=("group_name",)
    ),
    "Engine.update_weights_from_distributed": ApiUse(
        "method",
        _ENGINE,
        "Engine",
        "update_weights_from_distributed",
        params=("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format"),
    ),
    "UpdateWeightsFromDistributedReqInput": ApiUse(
        "fields",
        _IO,
        "UpdateWeightsFromDistributedReqInput",
        params=("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format"),
    ),
    # ---- weight update: tensors / CUDA IPC (colocated, or receive-then-hand-over) -------
    "Engine.update_weights_from_tensor": ApiUse(
        "method",
        _ENGINE,
        "Engine",
        "update_weights_from_tensor",
        params=("named_tensors", "load_format", "flush_cache"),
    ),
    "load_format flattened_bucket": ApiUse(
        "literal",
        "sglang.srt.model_executor",
        "",
        params=("flattened_bucket", "flattened_tensor", "metadata"),
        why="tp_worker / model runner branch on load_format == 'flattened_bucket' and read these dict keys",
    ),
    "FlattenedTensorMetadata": ApiUse(
        "fields",
        "sglang.srt.weight_sync.tensor_bucket",
        "FlattenedTensorMetadata",
        params=("name", "shape", "dtype", "start_idx", "end_idx", "numel"),
    ),
    "MultiprocessingSerializer.serialize": ApiUse(
        "method",
        "sglang.srt.utils.common",
        "MultiprocessingSerializer",
        "serialize",
        params=("obj",),
        why="re-exported as sglang.srt.utils.MultiprocessingSerializer",
    ),
    "monkey_patch_torch_reductions": ApiUse(
        "function",
        "sglang.srt.utils.patch_torch",
        "",
        "monkey_patch_torch_reductions",
        why="CUDA IPC payloads carry the device UUID instead of the index so each TP rank remaps it",
    ),
    "SafeUnpickler": ApiUse(
        "unpickle",
        "sglang.srt.utils.common",
        "SafeUnpickler",
        params=(
            "torch.multiprocessing.reductions:rebuild_cuda_tensor",
            "sglang.srt.utils.patch_torch:_rebuild_cuda_tensor_modified",
            "torch.multiprocessing.reductions:rebuild_tensor",
            "torch.multiprocessing.reductions:rebuild_storage_fd",
            "multiprocessing.resource_sharer:DupFd",
            "sglang.srt.weight_sync.tensor_bucket:FlattenedTensorMetadata",
            "sglang.srt.model_executor.model_runner:LocalSerializedTensor",
            "copyreg:__newobj__",
            "torch:Tensor",
            "torch.storage:UntypedStorage",
            "torch:Size",
            "torch:uint8",
            "torch:bfloat16",
            "torch:float16",
            "torch:float32",
            # block FP8 syncs (export_dtype=fp8-block): e4m3 weights travel beside float32 scales
            "torch:float8_e4m3fn",
        ),
        why="the scheduler unpickles update payloads with an allow-list (module prefixes in 0.5.10, exact "
        "(module, name) pairs in 0.5.23); every global our payloads pickle must pass it",
    ),
    "Fp8Config layers left unquantized": ApiUse(
        "literal",
        "sglang.srt.layers.quantization.fp8",
        "",
        params=("ignored_layers", "modules_to_not_convert"),
        why="Fp8Config.from_config reads the layers a block-FP8 checkpoint keeps 16-bit from these keys of its "
        "quantization_config; sglang_fp8.served_metas leaves them out of the weights it declares FP8",
    ),
    # ---- colocated: hand the GPU back to the trainer between rollouts --------------------
    "Engine.release_memory_occupation": ApiUse(
        "method", _ENGINE, "Engine", "release_memory_occupation", params=("tags",)
    ),
    "Engine.resume_memory_occupation": ApiUse(
        "method", _ENGINE, "Engine", "resume_memory_occupation", params=("tags",)
    ),
    "memory tags": ApiUse(
        "literal",
        "sglang.srt.constants",
        "",
        params=("weights", "kv_cache", "cuda_graph"),
        why="tag values release/resume_memory_occupation accept",
    ),
    "Engine() sets NCCL_CUMEM_ENABLE": ApiUse(
        "literal",
        _ENGINE,
        "",
        params=("NCCL_CUMEM_ENABLE",),
        why="Engine() sets it in the process that builds it (_set_envs_and_config); the adapter restores that "
        "process's value afterwards (sglang_engine.HOST_ENV_RESTORED) so rollout-svc's NCCL transport agrees "
        "with the trainer's",
    ),
    # ---- our loader inside SGLang's TP workers (sglang_loader.py) -------------------------
    "get_tensor_model_parallel_rank": ApiUse(
        "function",
        "sglang.srt.distributed.parallel_state",
        "",
        "get_tensor_model_parallel_rank",
        why="the loader picks its rank's result row",
    ),
    # tp_size > 1: each rank's own pickle of a bucket, opened on its GPU (sglang_peer.py); the class moved
    "LocalSerializedTensor (0.5.10)": ApiUse(
        "fields",
        "sglang.srt.model_executor.model_runner",
        "LocalSerializedTensor",
        params=("values",),
        optional=True,
        why="_unwrap_tensor deserialises values[tp_rank] in each worker; 0.5.10's place",
    ),
    "LocalSerializedTensor (0.5.2x)": ApiUse(
        "fields",
        "sglang.srt.model_executor.model_runner_components.weight_updater",
        "LocalSerializedTensor",
        params=("values",),
        optional=True,
        why="_unwrap_tensor deserialises values[tp_rank] in each worker; 0.5.2x's place",
    ),
    # 0.5.2x: a weight-update session that restores / re-packs weights SGLang keeps in a kernel
    # layout (quantised). Absent in 0.5.10; used when present.
    "Engine.begin_weight_update": ApiUse("method", _ENGINE, "Engine", "begin_weight_update", optional=True),
    "Engine.end_weight_update": ApiUse("method", _ENGINE, "Engine", "end_weight_update", optional=True),
}

# Names the adapter may import from sglang (module, attribute) — each must be backed by an entry.
SGLANG_IMPORTS: dict[tuple[str, str], str] = {
    ("sglang.srt.entrypoints.engine", "Engine"): "Engine",
    ("sglang.srt.server_args", "ServerArgs"): "ServerArgs",
    ("sglang.srt.managers.io_struct", "PauseGenerationReqInput"): "PauseGenerationReqInput",
    ("sglang.srt.managers.io_struct", "ContinueGenerationReqInput"): "ContinueGenerationReqInput",
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): "FlattenedTensorMetadata",
    ("sglang.srt.utils", "MultiprocessingSerializer"): "MultiprocessingSerializer.serialize",
    ("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions"): "monkey_patch_torch_reductions",
    ("sglang.srt.distributed.parallel_state", "get_tensor_model_parallel_rank"): "get_tensor_model_parallel_rank",
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): "LocalSerializedTensor (0.5.10)",
    (
        "sglang.srt.model_executor.model_runner_components.weight_updater",
        "LocalSerializedTensor",
    ): "LocalSerializedTensor (0.5.2x)",
}
