"""Collective check of the multi-sender export, for the torchrun scripts: every rank runs
`export_own_tensors()` at once (as the `stream` command does) and must yield exactly the tensors
`export_owners()` assigns it, in plan order, bit-exact against the checkpoint; nothing reaches rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_own_export(actor, want: dict[str, torch.Tensor]) -> tuple[bool, list[int]]:
    """(every rank yielded exactly its own tensors and nothing was forwarded, the sender ranks)."""
    rank, owners, metas, stats = dist.get_rank(), actor.export_owners(), actor.export_metas(), {}
    mine = [m.name for m, o in zip(metas, owners) if o == rank]
    own = list(actor.export_own_tensors(stats))
    good = [n for n, _ in own] == mine and all(torch.equal(t, want[n]) for n, t in own)
    row = torch.tensor([int(good), len(own), stats.get("forwarded_bytes", 0)], dtype=torch.int64)
    table = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(table, row)
    ok = (
        all(int(t[0]) for t in table)
        and sum(int(t[1]) for t in table) == len(metas)
        and all(int(t[2]) == 0 for t in table)
    )
    return ok, sorted(set(owners))


def check_hf_tensors_helper(actor) -> bool:
    """Collective: trainer_svc.actor.megatron.hf_tensors (what a user's own loop calls, its layout read
    from megatron's parallel state) yields on every rank exactly the actor's own export, in order."""
    from trainer_svc.actor.megatron.hf_tensors import hf_tensors

    got = list(hf_tensors(actor.model, actor.config, dtype=actor.export_dtype, mtp=actor.spec.mtp))
    want = list(actor.export_own_tensors())
    good = [n for n, _ in got] == [n for n, _ in want] and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    flag = torch.tensor([int(good)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
