"""Leader -> other ranks command channel: JSON bytes in a uint8 tensor, broadcast over a gloo group.

A multi-rank weight source has one control-plane rank (the group's rank 0: global rank 0 of a
trainer-svc job, or rank 0 of a collective `Publisher`'s group); the other ranks must enter the same
collective the leader is about to run (an export, a multi-sender stream). Commands are JSON, never
pickle, and travel on their own gloo groups (CPU tensors, even on GPU hosts) with timeouts the
owner chooses: trainer-svc's workers may legitimately wait hours for the next command, a
Publisher's ranks only for the sync they are in.
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
# the leader's wait for them even if a rank hangs
RESULT_TIMEOUT = timedelta(hours=1)


class CommandChannel:
    def __init__(
        self,
        group=None,
        *,
        command_timeout: timedelta = COMMAND_TIMEOUT,
        result_timeout: timedelta = RESULT_TIMEOUT,
    ):
        """Collective over the members of `group` (a torch.distributed group; None: the whole job).
        `command_timeout` bounds a rank's wait for the next command, `result_timeout` the leader's
        wait for every rank's result."""
        ranks = None if group is None else dist.get_process_group_ranks(group)
        if ranks is not None and len(ranks) == dist.get_world_size():
            ranks = None  # the whole job: built by every rank, as torch builds any group
        multi = dist.get_world_size(group) > 1
        #: this process's rank in the group, and the global rank of the group's rank 0 (the leader)
        self.rank = dist.get_rank(group)
        self.leader = 0 if group is None else dist.get_global_rank(group, 0)
        # a strict subgroup is built by its members alone (a rank outside it never calls this)
        local = ranks is not None
        self.group = (
            dist.new_group(ranks, timeout=command_timeout, backend="gloo", use_local_synchronization=local)
            if multi
            else None
        )
        self.results = (
            dist.new_group(ranks, timeout=result_timeout, backend="gloo", use_local_synchronization=local)
            if multi
            else None
        )
        #: leader -> senders while a multi-sender stream runs (the broadcast channel above is busy
        #: then): per-sync abort flags on the job's own store, which every rank already reaches
        self.flags = StoreFlags(dist.distributed_c10d._get_default_store()) if multi else None

    def send(self, op: str, **args) -> None:
        """On the leader: tell every other rank to run `op` (a no-op in a one-rank group)."""
        if self.group is None:
            return
        payload = torch.frombuffer(bytearray(json.dumps({"op": op, "args": args}).encode()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=self.leader, group=self.group)
        dist.broadcast(payload, src=self.leader, group=self.group)

    def receive(self) -> tuple[str, dict]:
        """On another rank: block until the leader sends the next command (at most command_timeout)."""
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=self.leader, group=self.group)
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=self.leader, group=self.group)
        msg = json.loads(bytes(payload.numpy()).decode())
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str) or not isinstance(msg.get("args"), dict):
            raise ValueError(f"malformed worker command {msg!r}")
        return msg["op"], msg["args"]

    def gather(self, result: dict) -> list[dict] | None:
        """Every rank: hand the leader a JSON result; the leader gets them all in group-rank order, others None."""
        payload = json.dumps(result).encode()
        if self.results is None:
            return [json.loads(payload)]
        world = dist.get_world_size(self.results)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.results)
        longest = max(int(n.item()) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if self.rank == 0 else None
        dist.gather(mine, bufs, dst=self.leader, group=self.results)
        if self.rank != 0:
            return None
        return [json.loads(bytes(b[: int(n.item())].numpy()).decode()) for b, n in zip(bufs, sizes)]
