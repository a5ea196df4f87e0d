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
from typing import Protocol

import torch

from weightsync.bus.channel import BucketSender
from weightsync.v1 import bus_pb2, rollout_pb2

#: (rollout entry, RPC name, request) -> (response or None, error text or "")
RpcCall = Callable[[object, str, object], tuple[object | None, str]]


class Session(Protocol):
    name: str
    #: where the pipeline packs buckets (cpu for tcp; the trainer's GPU for nccl and ipc)
    device: torch.device
    #: one target's failure fails every target of the sync (NCCL: a collective needs every rank)
    group_wide: bool
    #: the session reuses state a restarted peer may have lost (a cached NCCL group); the
    #: orchestrator retries once with fresh state when such a sync fails at prepare
    reused: bool

    def spec_for(self, entry) -> bus_pb2.TransportSpec:
        """The `transport` of this target's PrepareSyncRequest."""

    def accept(self, entry, resp: rollout_pb2.PrepareSyncResponse) -> str:
        """"" if the prepared target can be streamed to, else why not (it is then aborted)."""

    def open(self, targets: dict, timeout: float) -> BucketSender:
        """The channel reaching every prepared target (rollout_id -> entry)."""

    def finish(self, ok: bool, reason: str) -> None:
        """Called once after streaming: ok=False when the stream failed or never started."""


class Sender(Protocol):
    """A transport's trainer end, kept for the trainer's lifetime; opens one session per sync."""

    name: str

    def begin(self, targets: list, sync_id: str, bucket_bytes: int) -> Session:
        """A session for one sync; raises ValueError when this trainer cannot use the transport."""


def kind_of(resp: rollout_pb2.PrepareSyncResponse) -> str:
    return resp.transport.WhichOneof("kind") or "unset"
