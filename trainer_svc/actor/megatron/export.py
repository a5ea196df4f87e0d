"""Megatron -> HF export: gather -> rename/split -> cast, one parameter at a time.

For each entry of the export plan (in `export_metas` order) the owning pipeline stage's TP group
gathers the shards onto its TP rank 0, which writes every shard's pieces (the rule's transform)
straight into their regions of the HF tensors (hf_copy.py), casting on the way; an unsharded
parameter whose HF tensors are plain views of it in the export dtype is yielded as those views,
so the bucket's copy is the only one. (On one GPU the whole export can skip this iterator:
flat_export.py.) An expert's parameters are gathered the same way by the expert-TP group of
the EP rank that holds the expert (global index = ep_rank * experts_per_rank + local index). The
rank that assembled a tensor (its *owner*: `export_owners`) then either

- yields it itself (`to_rank0=False`, multi-sender streaming: every owner puts its own tensors on
  the bus, nothing crosses to rank 0), or
- sends it to global rank 0, which yields every tensor (`to_rank0=True`, the single-sender funnel).

Peak extra memory on any rank is about twice the largest gathered parameter. Every rank must drain
its iterator, since it takes part in the collectives (stopping early on one rank but not the others
deadlocks the job).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from trainer_svc.actor.megatron.hf_copy import copy_pairs
from trainer_svc.actor.megatron.hf_meta import export_plan
from trainer_svc.actor.megatron.model import named_parameters_global
from trainer_svc.actor.megatron.parallel import Parallelism, RankMap, layer_owner
from trainer_svc.actor.megatron.rules.base import LAYER, PRE, Dims, Rule, Site
from weightsync.model_spec import ModelSpec


def owner_stage(section: str, layer: int | None, num_layers: int, par: Parallelism) -> int:
    """The pipeline stage holding a rule's parameter (the embedding on the first, the head on the last)."""
    if section == PRE:
        return 0
    if section == LAYER:
        return layer_owner(layer, num_layers, par)[0]
    return par.pp - 1


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    # collectives move raw bytes so that any export dtype (bf16, fp8) works on gloo as on NCCL
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return b.view(dtype).reshape(shape)


def _device(params: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(params.values())).device


def _gather_tp(shard: torch.Tensor, tp_group, tp: int, tp_rank: int) -> list[torch.Tensor] | None:
    """All TP shards on TP rank 0 (None elsewhere); shards have equal shapes by construction."""
    if tp == 1:
        return [shard]
    raw = as_bytes(shard)
    bufs = [torch.empty_like(raw) for _ in range(tp)] if tp_rank == 0 else None
    dist.gather(raw, bufs, group=tp_group, group_dst=0)
    if tp_rank != 0:
        return None
    return [_from_bytes(b, shard.dtype, shard.shape) for b in bufs]


def _owner(rule: Rule, site: Site, d: Dims, par: Parallelism, rmap: RankMap) -> tuple[int, bool, str]:
    """(global rank that assembles the HF tensors, whether this rank holds a shard, group kind)."""
    stage = owner_stage(rule.section, site.layer, d.num_layers, par)
    if rule.expert:
        # megatron places global expert e on EP rank e // experts_per_rank (MoELayer's offsets)
        ep_rank = site.expert // (d.num_experts // par.ep)
        holds = rmap.in_expert_replica0 and rmap.pp_rank == stage and rmap.ep_rank == ep_rank
        return rmap.expert_leader[stage][ep_rank], holds, "expert"
    return rmap.stage_leader[stage], rmap.in_replica0 and rmap.pp_rank == stage, "dense"


def _assemble(
    rule: Rule, shards: list[torch.Tensor], names: list[str], shapes, d: Dims, export_dtype: torch.dtype
) -> list[torch.Tensor]:
    """The rule's HF tensors from its shards: views of the parameter when they need no conversion
    (the bucket's copy is then the only one), else written once each (hf_copy.py: no per-rank
    split temporaries, no concatenation)."""
    if len(shards) == 1 and rule.transform.to_hf_views and shards[0].dtype == export_dtype:
        out = rule.transform.to_hf(shards[0], d)
        return [t[: d.vocab_size] for t in out] if rule.vocab else out
    out = [torch.empty(shapes[n], dtype=export_dtype, device=shards[0].device) for n in names]
    for dst, src in copy_pairs(rule, shards, out, d):
        dst.copy_(src)
    return out


def _checked(names: list[str], out: list[torch.Tensor], shapes, par: Parallelism):
    for n, t in zip(names, out):
        if tuple(t.shape) != shapes[n]:
            raise ValueError(
                f"tensor {n}: exported shape {tuple(t.shape)} != HF shape {shapes[n]} (trainer {par.describe()})"
            )
        yield n, t


def export_owners(spec: ModelSpec, par: Parallelism, rmap: RankMap) -> list[int]:
    """The global rank that assembles each exported tensor, in `export_metas` order; from config
    alone, so every rank computes the same list without communicating."""
    owners: list[int] = []
    for rule, site, names in export_plan(spec):
        owners += [_owner(rule, site, spec.dims, par, rmap)[0]] * len(names)
    return owners


def runs_no_collective(par: Parallelism) -> bool:
    """Whether the multi-sender export (`to_rank0=False`) of this layout runs no collective: its only
    ones are the TP and expert-TP gathers (`_gather_tp`), and the funnel's sends to rank 0. A tied
    embedding is exported by stage 0 alone (the tied tables name no lm_head) and the MTP layers by the
    last stage from its own parameters, so a rank may then skip the export (flat_export.py) without
    leaving another rank waiting in a collective."""
    return par.tp == 1 and par.expert_tp == 1


def export_tensors(
    chunks,
    spec: ModelSpec,
    par: Parallelism,
    rmap: RankMap,
    export_dtype: torch.dtype,
    *,
    to_rank0: bool = True,
    stats: dict | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor): on rank 0 every tensor (to_rank0) or, without the funnel, on each
    owner rank the tensors it assembled. `stats['forwarded_bytes']` counts what rank 0 received."""
    from megatron.core import parallel_state as ps

    d, shapes = spec.dims, spec.hf_shapes
    params = named_parameters_global(chunks)
    # dense parameters split over the TP group, expert parameters over the expert-TP group
    groups = {"dense": (ps.get_tensor_model_parallel_group(), par.tp, rmap.tp_rank)}
    if d.num_experts:
        groups["expert"] = (ps.get_expert_tensor_parallel_group(), par.expert_tp, rmap.etp_rank)
    for rule, site, names in export_plan(spec):
        leader, holds, kind = _owner(rule, site, d, par, rmap)
        group, size, group_rank = groups[kind]
        out: list[torch.Tensor] | None = None
        if holds:
            mname = rule.megatron_name(site)
            if mname not in params:
                raise ValueError(
                    f"tensor {mname}: expected on this rank (pipeline stage {rmap.pp_rank}, EP rank "
                    f"{rmap.ep_rank}) but its model lacks it ({par.describe()})"
                )
            shard = params[mname].detach()
            gathered = rule.tp_dim is not None and size > 1
            if gathered:  # the collective moves the export dtype's bytes; unsharded, the copy below casts
                shard = shard.to(export_dtype)
            shards = _gather_tp(shard, group, size, group_rank) if gathered else [shard]
            if shards is not None and group_rank == 0:
                out = _assemble(rule, shards, names, shapes, d, export_dtype)
                del shards
        if not to_rank0:
            if rmap.rank == leader:
                yield from _checked(names, out, shapes, par)
            out = None
            continue
        if leader != 0:
            if rmap.rank == leader:
                for t in out:
                    dist.send(as_bytes(t), dst=0)
                out = None
            elif rmap.rank == 0:
                out = []
                for n in names:
                    buf = torch.empty(
                        torch.Size(shapes[n]).numel() * export_dtype.itemsize, dtype=torch.uint8, device=_device(params)
                    )
                    dist.recv(buf, src=leader)
                    out.append(_from_bytes(buf, export_dtype, shapes[n]))
                    if stats is not None:
                        stats["forwarded_bytes"] = stats.get("forwarded_bytes", 0) + buf.numel()
        if rmap.rank == 0:
            yield from _checked(names, out, shapes, par)
            out = None
