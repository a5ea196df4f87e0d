"""Rank 0 -> worker command channel: JSON bytes in a uint8 tensor, broadcast over a gloo group.

Under torchrun only global rank 0 runs the services; the other ranks sit in `MegatronActor.worker_loop`
and must enter the same collective method rank 0 is about to run. Commands are JSON, never pickle,
and travel on their own gloo group (CPU tensors, even on GPU hosts) with a long timeout, since a
worker may legitimately wait hours for the next command.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from weightsync.bus.nccl.liveness import StoreFlags

# an idle trainer is not an error: workers wait for the next command far longer than a collective
COMMAND_TIMEOUT = timedelta(days=30)
# results of a command (a sender's stream report) come back within its own timeout; this bounds
# rank 0's wait for them even if a rank hangs
RESULT_TIMEOUT = timedelta(hours=1)


class CommandChannel:
    def __init__(self):
        multi = dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT) if multi else None
        self.results = dist.new_group(backend="gloo", timeout=RESULT_TIMEOUT) if multi else None
        #: rank 0 -> senders while a multi-sender stream runs (the broadcast channel above is busy
        #: then): per-sync abort flags on the job's own store, which every rank already reaches
        self.flags = StoreFlags(dist.distributed_c10d._get_default_store()) if multi else None

    def send(self, op: str, **args) -> None:
        """On rank 0: tell every worker to run `op` (a no-op on a single-rank job)."""
        if self.group is None:
            return
        payload = torch.frombuffer(bytearray(json.dumps({"op": op, "args": args}).encode()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(payload, src=0, group=self.group)

    def receive(self) -> tuple[str, dict]:
        """On a worker: block until rank 0 sends the next command."""
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group)
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        msg = json.loads(bytes(payload.numpy()).decode())
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str) or not isinstance(msg.get("args"), dict):
            raise ValueError(f"malformed worker command {msg!r}")
        return msg["op"], msg["args"]

    def gather(self, result: dict) -> list[dict] | None:
        """Every rank: hand rank 0 a JSON result; rank 0 gets them all in rank order, others None."""
        payload = json.dumps(result).encode()
        if self.results is None:
            return [json.loads(payload)]
        world, rank = dist.get_world_size(), dist.get_rank()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.results)
        longest = max(int(n.item()) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, bufs, dst=0, group=self.results)
        if rank != 0:
            return None
        return [json.loads(bytes(b[: int(n.item())].numpy()).decode()) for b, n in zip(bufs, sizes)]
