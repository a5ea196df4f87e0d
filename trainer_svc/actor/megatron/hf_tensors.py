"""HF-named tensors from megatron-core model chunks, for a training loop that publishes its own weights.

    from trainer_svc.actor.megatron.hf_tensors import hf_tensors

    pub = Publisher(model=hf_config, group=torch.distributed.group.WORLD, ...)   # every rank
    pub.sync(hf_tensors(model_chunks, hf_config))                               # every rank, each step

The conversion is trainer-svc's own (rule tables in rules/, gather and assembly in export.py): the
shards of each parameter are gathered over its TP (expert-TP) group onto the owner — TP rank 0 and
data-parallel replica 0 of the pipeline stage holding it, or of the EP rank holding an expert — which
yields it under its HF name, in HF layout (fused QKV and gate/up split, vocabulary padding trimmed).
Every other rank yields nothing for it, so each tensor has exactly one owner, which is what a
Publisher over a group streams from.

Collective: every rank of the job calls it with its own chunks and drains the iterator (it runs the
gathers; `Publisher.sync` drains it). Megatron's parallel state must be initialised (the layout is
read from it). The chunks are those of a GPTModel built with the local or the Transformer Engine
spec for a family this project has rules for (docs/conversion.md); anything else is refused naming
the tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainer_svc.actor.megatron.parallel import Parallelism


def current_parallelism() -> Parallelism:
    """The TP/PP/VPP/EP layout megatron's parallel state was initialised with."""
    from megatron.core import parallel_state as ps

    return Parallelism(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )


def hf_tensors(
    model_chunks, hf_config, *, dtype: torch.dtype = torch.float32, mtp: str = "off"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every tensor this rank owns, in the HF checkpoint's order.
    `model_chunks`: this rank's GPTModel chunks (a list, one per virtual pipeline stage; a single
    model is taken as one chunk). `mtp`: carry multi-token-prediction layers under 'deepseek' or
    'mimo' names ('off': none). The HF config is the one the Publisher declares."""
    from trainer_svc.actor.megatron.export import export_tensors
    from trainer_svc.actor.megatron.hf_meta import build_spec
    from trainer_svc.actor.megatron.parallel import rank_map

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    spec = build_spec(hf_config, mtp)
    return export_tensors(chunks, spec, current_parallelism(), rank_map(), dtype, to_rank0=False)
