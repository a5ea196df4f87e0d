"""A channel: what moves filled bucket buffers of one sync from the trainer to the rollouts.

Channels never see tensors or names, only (BucketPlan, flat uint8 buffer). The trainer's
BucketSender is one object per sync that reaches every targeted rollout; a BucketReceiver is
one object per sync and rollout engine rank. Every blocking call takes or inherits a deadline.
Each transport (tcp/, nccl/, ipc/) has its own pair; the pipeline only knows these protocols.
"""
from __future__ import annotations

from typing import Protocol

import torch

from weightsync.bus.plan import BucketPlan


class BucketSender(Protocol):
    def send(self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None) -> None:
        """Deliver `buf[:plan.nbytes]` to every live target; return when `buf` may be reused.

        A target that fails is recorded in `failures()` and skipped from then on; the call
        raises TransportError (weightsync.bus.errors) only when no target is left (or a collective
        transport fails).
        """

    # A sender may instead set `releases_previous = True`: then `send(k)` only has to make the
    # buffer of bucket k-1 reusable (bucket k may still be on the wire), and `flush()` waits for
    # everything. This lets a collective channel keep the wire busy without host round trips.
    # And `checksums_in_band` ("all" by default, "first" or "none"): which buckets' checksums it
    # carries with the bucket; the others reach the rollouts with the commit, so the pipeline
    # need not wait for them before sending (weightsync/bus/pipeline.py).

    def failures(self) -> dict[str, str]:
        """target id -> error text for targets that dropped out during this sync."""

    def close(self) -> None: ...


class BucketReceiver(Protocol):
    def recv(self, plan: BucketPlan, timeout: float) -> tuple[torch.Tensor, int | None]:
        """Return (buffer holding the bucket's bytes, sender's checksum if the transport carries one).

        The buffer is valid until the next `recv` call.
        """

    def close(self) -> None: ...
