"""A channel: what moves filled bucket buffers of one sync from the trainer to the rollouts.

Channels never see tensors or names, only (BucketPlan, flat uint8 buffer). The trainer's
BucketSender is one object per sync that reaches every targeted rollout; a BucketReceiver is
one object per sync and rollout engine rank. Every blocking call takes or inherits a deadline.
Each transport (tcp/, nccl/, ipc/) has its own pair, subclassing these; the pipeline only knows
these classes, and what a channel can do is declared on them (the defaults are the simplest channel's).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from weightsync.bus.plan import BucketPlan


class BucketSender:
    #: False: `send(k)` returns once bucket k's buffer may be reused. True: `send(k)` only has to
    #: make bucket k-1's buffer reusable (bucket k may still be on the wire) and `flush()` waits
    #: for everything, which lets a collective channel keep the wire busy without host round trips.
    releases_previous: bool = False
    #: which buckets' checksums it carries with the bucket: "all", "first" or "none"; the others
    #: reach the rollouts with the commit, so the pipeline need not wait for them before sending
    #: (weightsync/bus/pipeline.py)
    checksums_in_band: str = "all"
    #: True: the channel computes every bucket's checksum in its own pass over the bytes (a trainer
    #: writing into the engine, weightsync/bus/ipc/trainer_writes.py): the pipeline sums nothing and
    #: takes `checksums()` after `flush()`
    computes_checksums: bool = False
    #: every target takes the same broadcast (a collective: nccl): deltas go to all of them or none,
    #: as frames of `framed()` (weightsync/bus/nccl/framed.py)
    collective: bool = False
    #: target id -> bytes this channel put on the bus for it, frames included ({}: not counted)
    wire_bytes: Mapping[str, int] = MappingProxyType({})
    #: a framed broadcast's bytes, headers included, which every member took (None: not framed)
    wire_bytes_sent: int | None = None
    #: computes_checksums channels: the parts of their send time by name (e.g. queue, wait, read)
    phase_seconds: Mapping[str, float] = MappingProxyType({})
    #: target id -> payload bytes its connection took so far, counted while a bucket goes out (tcp): the
    #: stream's liveness watch drops a target only on silence and no progress (None: not counted)
    sent_bytes: Mapping[str, int] | None = None

    def send(self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None) -> None:
        """Deliver `buf[:plan.nbytes]` to every live target; return when `buf` may be reused.

        A target that fails is recorded in `failures()` and skipped from then on; the call
        raises TransportError (weightsync.bus.errors) only when no target is left (or a collective
        transport fails).
        """
        raise NotImplementedError

    def send_held(self, plans: list[BucketPlan], bufs: list[torch.Tensor]) -> bool:
        """Every bucket at once, from buffers that already hold their bytes and stay unchanged until
        the sync ends (the actor's own storage; its writes may still be queued on this process's
        current stream): True when this channel sent them all (the pipeline then only calls `flush`);
        False, with nothing sent, when it takes them one `send` at a time."""
        return False

    def write_fp8_from(self, weights) -> bool:
        """A channel that writes block-FP8 weights into the engine from the trainer's parameters
        (the actor's `flat_fp8_weights`): True when it took them (no quantize pass into the buckets
        is needed); False, taking nothing, for every other channel."""
        return False

    def framed(self) -> BucketSender:
        """A collective channel's sender of framed buckets, dense or delta (nccl/framed.py)."""
        raise NotImplementedError(f"{type(self).__name__} is not a collective channel")

    def flush(self) -> None:
        """After the last `send` of a releases_previous channel (the pipeline calls it for those alone):
        wait until every bucket is delivered."""

    def checksums(self) -> list[int]:
        """computes_checksums channels, after `flush`: every bucket's checksum, in bucket order."""
        raise NotImplementedError(f"{type(self).__name__} computes no checksum")

    def failures(self) -> dict[str, str]:
        """target id -> error text for targets that dropped out during this sync."""
        return {}

    def drop(self, tid: str, why: str) -> bool:
        """Take target `tid` out of the stream now, from any thread (its rollout went silent): the
        others' sends must not wait on it any more, and `failures()` reports `why`. False when this
        channel cannot (a collective needs every member; a colocated IPC target shares the trainer's
        fate) or `tid` already left."""
        return False

    def close(self) -> None:
        pass

    # A channel of a transport that commits on its stream (weightsync.bus.transports: commit_on_stream)
    # also routes the commits:
    def commit_on_stream(self, rollout_ids) -> None:
        """These targets take the commit on this channel's stream, with `commit`, after `flush`."""
        raise NotImplementedError(f"{type(self).__name__} carries no commit")

    def commit_elsewhere(self, rollout_ids) -> None:
        """These targets commit over another path once `flush` returns (the channel is closed after)."""
        raise NotImplementedError(f"{type(self).__name__} carries no commit")

    def commit(self, rid: str, request, timeout: float | None = None):
        """(CommitSyncResponse, "") or (None, error): `rid`'s commit on its stream."""
        raise NotImplementedError(f"{type(self).__name__} carries no commit")


def drops_targets(channel) -> bool:
    """Whether `channel` can take one target out of its stream (its class overrides `drop`): only then
    is watching the targets' liveness during the stream of any use."""
    return getattr(type(channel), "drop", BucketSender.drop) is not BucketSender.drop


class BucketReceiver:
    def recv(self, plan: BucketPlan, timeout: float) -> tuple[torch.Tensor, int | None]:
        """Return (buffer holding the bucket's bytes, sender's checksum if the transport carries one).

        The buffer is valid until the next `recv` call.
        """
        raise NotImplementedError

    def close(self) -> None:
        pass
