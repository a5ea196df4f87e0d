"""SGLang's receive side, run from SGLang's own code on CPU, behind the `Engine` methods the
adapter calls. Imported only inside the subprocess that `tests.support.sglang_site.activate`d.

`SglangSide` stands where `sglang.srt.entrypoints.engine.Engine` stands for the adapter. What it
does NOT run is the process plumbing between SGLang's Engine and its scheduler (ZMQ, asyncio,
the scheduler loop); each method does in-process what that plumbing ends in, calling SGLang's
functions in SGLang's order:
  update_weights_from_tensor:  what Engine._serialize_tensors_per_rank does (normalize per-rank
      payloads, or MultiprocessingSerializer.serialize a named list) -> what
      TpModelWorker.deserialize_own_rank does (monkey_patch_torch_reductions + SafeUnpickler;
      both restated in two lines each: their modules import the HTTP server and scheduler stacks) ->
      WeightUpdater.update_weights_from_tensor
      (FlattenedTensorBucket.reconstruct_tensors for "flattened_bucket") -> model.load_weights
  update_weights_from_distributed: WeightUpdater.receive_weights_from_distributed (its
      FlattenedTensorBucket.empty + broadcast; the broadcast is the one stand-in: it copies the
      trainer's dense bucket) -> WeightUpdater.load_weights_from_distributed -> model.load_weights
"""

from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_0_5_2x() -> bool:
    """0.5.2x moved the weight updater out of ModelRunner and parallel widths into runtime_context."""
    import importlib.util

    return importlib.util.find_spec("sglang.srt.runtime_context") is not None


def init_tp1() -> None:
    """SGLang's own world-size-1 parallel state on gloo (what its layer tests do at TP=1)."""
    init_tp(0, 1, free_port())


def init_tp(rank: int, size: int, port: int) -> None:
    """SGLang's own parallel state of TP rank `rank` of `size` on gloo (one process per rank, rendezvous on
    `port`): its layers then shard as they do in a TP worker."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.server_args import ServerArgs

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank)
    )
    init_distributed_environment(world_size=size, rank=rank, local_rank=rank, backend="gloo")
    if _is_0_5_2x():
        from sglang.srt.distributed import parallel_state
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

        reset_context()
        publish(
            ServerArgs(model_path="dummy", tp_size=size, ep_size=1, pp_size=1, device="cpu"),
            role="test",
            ranks=SpawnRanks(world_rank=rank),
        )
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    else:
        from types import SimpleNamespace

        from sglang.srt.layers.dp_attention import initialize_dp_attention
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        # [] as after a launch's post-init
        args = ServerArgs(model_path="dummy", device="cpu", custom_weight_loader=[], tp_size=size)
        set_global_server_args_for_scheduler(args)
        initialize_model_parallel(tensor_model_parallel_size=size, backend="gloo")
        # What ModelRunner does next; of the model config it reads hidden_size and dtype only
        # (for a gather buffer that these checks, without DP attention, never use).
        initialize_dp_attention(server_args=args, model_config=SimpleNamespace(hidden_size=64, dtype=torch.bfloat16))


MODEL_CLASSES = {
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}


def build_model(hf_config, dtype: torch.dtype) -> torch.nn.Module:
    """SGLang's model class for the config, params in `dtype`, every value NaN (so a parameter that
    load_weights never writes cannot pass a comparison)."""
    import importlib

    mod, cls = MODEL_CLASSES[hf_config.model_type]
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = getattr(importlib.import_module(f"sglang.srt.models.{mod}"), cls)(hf_config)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return model


class SglangSide:
    """Engine-level calls in, SGLang's receive code out (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tp_size: int = 1):
        self.model = model
        self.tp_size = tp_size
        if _is_0_5_2x():
            from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

            self.updater = WeightUpdater(
                tp_rank=0,
                device="cpu",
                gpu_id=0,
                model_config=None,
                custom_weight_loaders={},
                get_model=lambda: model,
                update_model_fields=lambda **_: None,
                recapture_cuda_graph=lambda: None,
                get_model_runner=lambda: None,
            )
        else:
            self.updater = _runner_0_5_10(model)
        self.broadcast_source: torch.Tensor | None = None  # the trainer's dense bucket, per call
        self.calls: list[tuple[str, dict]] = []

    # -- sglang.srt.entrypoints.engine.Engine surface the adapter uses ----------------------
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        self.calls.append(("update_weights_from_tensor", dict(load_format=load_format, flush_cache=flush_cache)))
        # Engine._serialize_tensors_per_rank's two statements (importing sglang.srt.entrypoints.engine
        # would pull the HTTP server stack: uvloop, fastapi, ...).
        if load_format == "flattened_bucket" and _is_0_5_2x():
            from sglang.srt.utils import normalize_serialized_named_tensor_payloads

            per_rank = normalize_serialized_named_tensor_payloads(named_tensors)
        elif load_format == "flattened_bucket":  # 0.5.10 passes them through
            per_rank = list(named_tensors)
        else:
            per_rank = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.tp_size)]
        assert len(per_rank) == self.tp_size, f"{len(per_rank)} payloads for {self.tp_size} TP ranks"
        # TpModelWorker.deserialize_own_rank's two statements (tp_worker imports the scheduler).
        monkey_patch_torch_reductions()
        data = MultiprocessingSerializer.deserialize(per_rank[0])  # TP rank 0
        return self.updater.update_weights_from_tensor(named_tensors=data, load_format=load_format)

    def init_weights_update_group(self, **kw):
        self.calls.append(("init_weights_update_group", kw))
        self.updater._model_update_group[kw["group_name"]] = "stand-in group"
        return True, "ok"

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache=True, load_format=None):
        self.calls.append(("update_weights_from_distributed", dict(group_name=group_name, load_format=load_format)))
        src = self.broadcast_source
        real = torch.distributed.broadcast

        def broadcast(tensor, src_rank=0, group=None, async_op=False, **kw):
            # The one stand-in: NCCL's broadcast from the trainer (rank 0) into SGLang's buffer.
            assert group == "stand-in group" and tensor.dtype == torch.uint8
            assert tensor.numel() == src.numel(), (
                f"SGLang allocated {tensor.numel()} bytes, trainer sends {src.numel()}"
            )
            tensor.copy_(src)

        torch.distributed.broadcast = broadcast
        try:
            if not _is_0_5_2x():  # 0.5.10: ModelRunner receives and loads in one call
                return self.updater.update_weights_from_distributed(
                    names, dtypes, shapes, group_name, load_format=load_format
                )
            weights = self.updater.receive_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, load_format=load_format
            )
        finally:
            torch.distributed.broadcast = real
        return self.updater.load_weights_from_distributed(weights)


def _runner_0_5_10(model):
    """0.5.10's weight-update methods are ModelRunner methods: run them on an object holding only
    the attributes they read (building a whole ModelRunner needs a GPU, a KV pool, ...)."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import get_global_server_args

    methods = (
        "update_weights_from_tensor",
        "_update_weights_from_flattened_bucket",
        "update_weights_from_distributed",
        "_update_bucketed_weights_from_distributed",
    )
    runner_cls = type("ModelRunnerWeightPaths", (), {m: getattr(ModelRunner, m) for m in methods})
    runner = runner_cls()
    runner.model, runner.device, runner.tp_rank = model, "cpu", 0
    runner.server_args = get_global_server_args()
    runner._model_update_group = {}
    return runner
