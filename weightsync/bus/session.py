"""The contract between the trainer's sync orchestrator and a transport's sender.

Each transport's sender (tcp/sender.py, nccl/sender.py, ipc/sender.py) opens a session per
sync that says what to put in PrepareSync for each target, checks each target's answer, and
opens the channel (a BucketSender) once the targets are prepared. The orchestrator runs
plan → prepare → stream → commit | abort the same way for every transport; a transport only
decides what each target is told, whether its answer is usable, how buckets move, and whether
one target's failure fails them all (a collective).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightsync.bus.channel import BucketSender
from weightsync.bus.transports import TrainerSide, choices, multi_sender_names
from weightsync.v1 import bus_pb2, rollout_pb2

#: (rollout entry, RPC name, request) -> (response or None, error text or "")
RpcCall = Callable[[object, str, object], tuple[object | None, str]]


class Session:
    """One sync's part of a transport's trainer end; the defaults are those of a transport that
    needs none of the optional steps."""

    name: str = ""
    #: where the pipeline packs buckets (cpu for tcp; the trainer's GPU for nccl and ipc)
    device: torch.device = torch.device("cpu")
    #: one target's failure fails every target of the sync (NCCL: a collective needs every rank)
    group_wide: bool = False
    #: the session reuses state a restarted peer may have lost (a cached NCCL group); the
    #: orchestrator retries once with fresh state when such a sync fails at prepare
    reused: bool = False
    #: bucket buffers kept across syncs for the pipeline to pack into (a BufferPool), or None
    buffers = None
    #: the channel can take each target's commit on its stream (Transport.commit_on_stream)
    commit_on_stream: bool = False
    #: why a prepared target cannot be streamed to while several ranks send ("" when none can't):
    #: the sync is then retried from global rank 0 alone
    sender_gpu_clash: str = ""
    #: the rollout ids of that clash
    clashing: frozenset[str] = frozenset()
    #: before prepare: whether the channel is expected to compute the bucket checksums as it sends
    #: (ipc, trainer writes), so the trainer need not start its own checksum pass meanwhile
    expects_channel_sums: bool = False
    #: who writes this sync into the engine, for a transport that lets a sync choose
    #: (Transport.writers: ipc's trainer_writes or rollout_reads), settled once prepare answered;
    #: "" for the others (their rollouts receive)
    direction: str = ""

    def spec_for(self, entry) -> bus_pb2.TransportSpec:
        """The `transport` of this target's PrepareSyncRequest."""
        raise NotImplementedError

    def accept(self, entry, resp: rollout_pb2.PrepareSyncResponse) -> str:
        """ "" if the prepared target can be streamed to, else why not (it is then aborted)."""
        raise NotImplementedError

    def open(self, targets: dict, timeout: float) -> BucketSender:
        """The channel reaching every prepared target (rollout_id -> entry)."""
        raise NotImplementedError

    def cut(self, rollout_id: str, why: str) -> bool:
        """Mid-stream, `rollout_id` went silent and its channel cannot drop it alone (a collective):
        end the stream for every target so the live ones can be synced again without it (nccl/cut.py).
        False: this session cannot (the sync's deadline bounds the stream)."""
        return False

    def committing(self, rollout_ids) -> None:
        """These targets were sent their CommitSync before the stream's last transfers completed: a
        watch of the stream must not take one that committed meanwhile for one that left the sync."""

    def cut_reasons(self) -> dict[str, str]:
        """rollout id -> why it was cut out of this session's stream (`cut`); empty for a session that cannot cut."""
        return {}

    def use_manifest(self, manifest) -> None:
        """The sync's manifest, once planned (before any prepare)."""

    def use_quantized_writes(self, writes) -> None:
        """How a quantized manifest is written into an engine (ipc trainer_writes: a
        trainer_writes.QuantizedWrites from weightsync.formats, which the bus cannot import); called
        before any prepare of a quantized sync. A session that never writes into an engine ignores it."""

    def finish(self, ok: bool, reason: str) -> None:
        """Called once after streaming: ok=False when the stream failed or never started."""

    def use_senders(self, senders: list[int], rank_gpus: list[str] | None = None) -> None:
        """Several trainer ranks stream this sync (each the buckets it owns); called before any prepare.
        `rank_gpus`: each global rank's GPU UUID, when the actor knows them."""

    def use_in_place(self, buffers: list[torch.Tensor]) -> None:
        """The pipeline sends the actor's own bucket storage this sync instead of packed buffers."""

    def owner_streams(
        self, prepared: dict, timeout: float, raise_flag: Callable[[str], None] | None
    ) -> tuple[dict[str, str], dict[str, dict] | None, float]:
        """What every sending rank needs to stream its own buckets to the `prepared` targets
        (rollout_id -> entry), for weightsync.publisher.multisender: (rollout_id -> data address,
        str(sender rank) -> its group's job fields or None, how often a sender looks for the abort
        flag). `raise_flag(reason)` tells every sender to stop (None: the actor has no flags)."""
        raise ValueError(
            f"transport {self.name} carries the buckets of one sender; multi-sender streaming is "
            f"{choices(multi_sender_names())}"
        )


class Sender:
    """A transport's trainer end, kept for the trainer's lifetime; opens one session per sync."""

    name: str = ""

    @classmethod
    def for_trainer(cls, side: TrainerSide) -> "Sender":
        """This end as a trainer builds it (weightsync.bus.transports)."""
        raise NotImplementedError

    def begin(self, targets: list, sync_id: str, bucket_bytes: int) -> Session:
        """A session for one sync; raises ValueError when this trainer cannot use the transport."""
        raise NotImplementedError


def kind_of(resp: rollout_pb2.PrepareSyncResponse) -> str:
    return resp.transport.WhichOneof("kind") or "unset"
