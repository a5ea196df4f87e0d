"""The TP gathers of the flat export at TP > 1: each sharded dense parameter's shards sent by the
other TP ranks of its stage straight into the places the stage leader planned for them.

Which parameters travel, and in which order, follows from config alone (the export plan, the
parallel layout, the rank's stage: `sharded_names`), so every rank of a TP group computes the same
list and the leader's receives pair up with the others' sends without exchanging a plan. A remote
shard travels as the export dtype's bytes (as export.py's gathers: the sender casts) and lands either
in its HF slot itself (a vocabulary shard whose rows all lie inside the HF vocabulary: bytes of the
slot in order) or in a buffer the plan allocated once (flat_export.py), from which the planned copies
write the slots. A sync's sends and receives go in one batch (`batch_isend_irecv`: one NCCL group).

Every rank of the group must run each sync's exchange, or the others wait forever: `agree()` first
makes the decision (flat, or the per-tensor export) the same on all of them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer_svc.actor.megatron.export import as_bytes, owner_stage
from trainer_svc.actor.megatron.hf_meta import export_plan
from trainer_svc.actor.megatron.parallel import Parallelism
from weightsync.model_spec import ModelSpec

#: bound on one sync's exchange (seconds): a TP rank that never sends fails the sync instead of hanging it
EXCHANGE_TIMEOUT_S = 600.0


def sharded_names(spec: ModelSpec, par: Parallelism, pp_rank: int) -> list[str]:
    """The Megatron names of the dense TP-sharded parameters of pipeline stage `pp_rank`, in export
    order: what the stage's TP ranks exchange at each flat sync (empty at TP = 1)."""
    if par.tp == 1:
        return []
    d = spec.dims
    return [
        rule.megatron_name(site)
        for rule, site, _ in export_plan(spec)
        if not rule.expert
        and rule.tp_dim is not None
        and owner_stage(rule.section, site.layer, d.num_layers, par) == pp_rank
    ]


@dataclass(frozen=True)
class TpGroup:
    """This rank's TP group as the flat export's exchange sees it."""

    group: object  # the process group
    ranks: tuple[int, ...]  # global rank of each TP rank, in TP rank order
    tp_rank: int
    names: tuple[str, ...]  # sharded_names() of this rank's stage
    export_dtype: torch.dtype

    @property
    def leader(self) -> int:
        return self.ranks[0]


def tp_group(spec: ModelSpec, par: Parallelism, pp_rank: int, tp_rank: int, export_dtype: torch.dtype) -> TpGroup:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    return TpGroup(group, ranks, tp_rank, tuple(sharded_names(spec, par, pp_rank)), export_dtype)


def agree(ok: bool, g: TpGroup, device: torch.device) -> bool:
    """Whether every rank of the group can take the flat path this sync (a collective: each rank's
    own verdict in, the same answer out on all)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g.group)
    return bool(flag.item())


def send_shards(params: dict[str, torch.Tensor], g: TpGroup) -> None:
    """A non-leader TP rank's part of a sync: its shard of every sharded parameter, in order, to the leader."""
    if g.tp_rank == 0:
        raise ValueError("send_shards: TP rank 0 receives the shards; it sends none")
    missing = [n for n in g.names if n not in params]
    if missing:
        raise ValueError(f"tensor {missing[0]}: a sharded parameter of this stage is not on this rank")
    with torch.no_grad():
        # the cast (when the parameters are not in the export dtype) is a fresh tensor kept until the sends end
        shards = [params[n].detach().to(g.export_dtype).contiguous() for n in g.names]
        _exchange([dist.P2POp(dist.isend, as_bytes(s), g.leader, g.group) for s in shards])


class ShardReceives:
    """The leader's receives of a sync: (TP rank, byte view it lands in) per remote shard, planned once."""

    def __init__(self, g: TpGroup, targets: list[tuple[int, torch.Tensor]]):
        self.group = g
        self.targets = targets
        self.bytes = sum(t.numel() for _, t in targets)

    def run(self) -> None:
        g = self.group
        _exchange([dist.P2POp(dist.irecv, t, g.ranks[r], g.group) for r, t in self.targets])


def _exchange(ops: list) -> None:
    if not ops:
        return
    timeout = datetime.timedelta(seconds=EXCHANGE_TIMEOUT_S)
    for work in dist.batch_isend_irecv(ops):
        work.wait(timeout)
