"""Process group and Megatron parallel-state setup, and the rank map export/load need.

Megatron orders ranks tp-fastest (tp, cp, ep, dp, pp), and lays a second grid over the same ranks
for the experts (expert-TP, EP, expert-DP, pp); rather than re-derive either order, every rank
publishes its coordinates in both once and the map is read from the gathered table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1  # expert parallel: experts split over ep ranks (MoE models)
    etp: int | None = None  # expert tensor parallel; None: megatron's default, = tp

    def __post_init__(self):
        for field_name in ("tp", "pp", "vpp", "ep"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name}={getattr(self, field_name)} must be >= 1")
        if self.etp is not None and self.etp < 1:
            raise ValueError(f"etp={self.etp} must be >= 1")
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(f"vpp={self.vpp} needs pp >= 2 (virtual stages interleave pipeline ranks)")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def describe(self) -> str:
        s = f"TP={self.tp} PP={self.pp} VPP={self.vpp}"
        if self.ep > 1 or self.expert_tp != self.tp:
            s += f" EP={self.ep} ETP={self.expert_tp}"
        return s


def init_distributed() -> None:
    """Join the torchrun job (env://), or start a one-process group when not under torchrun."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        # One process: an in-memory store, so nothing listens. A tcp:// init method would start a
        # TCPStore server, which binds every interface whatever host the URL names.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_model_parallel(par: Parallelism) -> None:
    from megatron.core import parallel_state as ps

    init_distributed()
    world = dist.get_world_size()
    if world % (par.tp * par.pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp={par.tp * par.pp} ({par.describe()})")
    if world % (par.expert_tp * par.ep * par.pp):
        raise ValueError(
            f"world size {world} is not a multiple of etp*ep*pp={par.expert_tp * par.ep * par.pp} ({par.describe()})"
        )
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if have != (par.tp, par.pp, par.ep, par.expert_tp):
            raise ValueError(
                f"megatron parallel state is already initialised with a different layout than {par.describe()}"
            )
        return
    ps.initialize_model_parallel(
        par.tp,
        par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
    )


@dataclass(frozen=True)
class RankMap:
    """Where this rank sits, and which global rank leads each piece of the model: (tp=0, dp=0) of
    each pipeline stage for dense parameters, (etp=0, edp=0) of each (stage, EP rank) for experts."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    stage_leader: tuple[int, ...]  # global rank of tp=0,dp=0 for each pp rank
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    expert_leader: tuple[tuple[int, ...], ...] = ()  # [pp rank][ep rank] -> global rank of etp=0,edp=0

    @property
    def in_replica0(self) -> bool:
        """Only data-parallel replica 0 takes part in export; the others hold the same weights."""
        return self.dp_rank == 0

    @property
    def in_expert_replica0(self) -> bool:
        """The same for expert parameters, which are replicated over the expert-data-parallel group."""
        return self.edp_rank == 0


def rank_map() -> RankMap:
    from megatron.core import parallel_state as ps

    me = torch.tensor(
        [
            dist.get_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_data_parallel_rank(),
        ],
        dtype=torch.int64,
    )
    if torch.cuda.is_available():
        me = me.cuda()
    table = [torch.zeros_like(me) for _ in range(dist.get_world_size())]
    dist.all_gather(table, me)
    rows = [tuple(int(x) for x in t.cpu()) for t in table]
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    leaders = [next(r[0] for r in rows if r[1] == 0 and r[3] == 0 and r[2] == stage) for stage in range(pp)]
    expert_leaders = [
        tuple(next(r[0] for r in rows if r[2] == stage and r[4] == e and r[5] == 0 and r[6] == 0) for e in range(ep))
        for stage in range(pp)
    ]
    _, tp_rank, pp_rank, dp_rank, ep_rank, etp_rank, edp_rank = rows[dist.get_rank()]
    return RankMap(
        dist.get_rank(), tp_rank, pp_rank, dp_rank, tuple(leaders), ep_rank, etp_rank, edp_rank, tuple(expert_leaders)
    )


def layer_owner(layer: int, num_layers: int, par: Parallelism) -> tuple[int, int]:
    """(pp rank, virtual stage) holding a global layer under Megatron's uniform interleaved split:
    virtual stage c of pp rank p holds layers [(c*pp + p) * n, (c*pp + p + 1) * n), n = L/(pp*vpp)."""
    per_chunk = num_layers // (par.pp * par.vpp)
    chunk = layer // per_chunk
    return chunk % par.pp, chunk // par.pp
