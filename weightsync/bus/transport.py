"""What a transport is: something that moves filled bucket buffers from one sender to receivers.

Transports never see tensors or names, only (BucketPlan, flat uint8 buffer). The sender side
is one object per sync that reaches every targeted rollout; the receiving side is one object
per rollout engine rank. Every blocking call takes or inherits a deadline.
"""
from __future__ import annotations

from typing import Protocol

import torch

from weightsync.bus.plan import BucketPlan


class TransportError(RuntimeError):
    """Moving bytes failed (peer gone, timeout, corrupt frame). The sync must abort."""


class BucketSender(Protocol):
    def send(self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None) -> None:
        """Deliver `buf[:plan.nbytes]` to every live target; return when `buf` may be reused.

        A target that fails is recorded in `failures()` and skipped from then on; the call
        raises TransportError only when no target is left (or a collective transport fails).
        """

    # A sender may instead set `releases_previous = True`: then `send(k)` only has to make the
    # buffer of bucket k-1 reusable (bucket k may still be on the wire), and `flush()` waits for
    # everything. This lets a collective transport keep the wire busy without host round trips.

    def failures(self) -> dict[str, str]:
        """target id -> error text for targets that dropped out during this sync."""

    def close(self) -> None: ...


class BucketReceiver(Protocol):
    def recv(self, plan: BucketPlan, timeout: float) -> tuple[torch.Tensor, int | None]:
        """Return (buffer holding the bucket's bytes, sender's checksum if the transport carries one).

        The buffer is valid until the next `recv` call.
        """

    def close(self) -> None: ...
