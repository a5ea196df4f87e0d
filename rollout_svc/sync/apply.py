"""How received buckets reach the engine: the interface of the two apply strategies.

The transaction (transaction.py) owns a sync's lifecycle — prepare, bucket bookkeeping, checksums at
commit, abort, the served version — and hands every bucket and the commit's apply to the strategy
its `apply_mode` selects:
- staged  (apply_staged.py)  — tensors are held until commit, then loaded under the engine gate in
                               one go; the old version serves while bytes stream.
- inplace (apply_inplace.py) — the gate is taken at the first bucket and buckets are loaded as they
                               arrive; an abort after the first bucket leaves the engine STALE.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from rollout_svc.engine.base import Engine
from rollout_svc.sync.delta_base import DeltaBase
from rollout_svc.sync.engine_gate import EngineGate
from rollout_svc.sync.pending import PendingSync
from weightsync.bus.plan import BucketPlan
from weightsync.formats.fp8.dequantize_slots import FusedDequant


class SyncHost(Protocol):
    """What a strategy uses of the transaction it serves."""

    engine: Engine
    delta_base: DeltaBase  # the base copy delta buckets apply onto, and whether the engine holds it
    engine_lock: EngineGate  # a sync holds it exclusively while it changes the weights
    state_lock: threading.RLock  # guards the transaction's state and its pending sync
    state: int  # rollout_pb2.EngineState

    def left_behind(self, p: PendingSync) -> bool:
        """`p` is no longer the sync in progress: aborted, or superseded by a newer prepare."""

    def abort_locked(self, reason: str) -> None:
        """Abort the pending sync; the caller holds state_lock."""


class ApplyStrategy(ABC):
    mode: str

    def __init__(self, host: SyncHost):
        self.host = host
        #: block-FP8 buckets written into the parameters by one launch each (fp8_fused_write.py); kept
        #: across syncs (its tables and held scales are per layout)
        self.fp8 = FusedDequant()

    @abstractmethod
    def consume(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool
    ) -> tuple[object, bool]:
        """Take bucket `plan` (bytes in `buf`) of sync `p`: (our checksum — an int, a PendingChecksum
        read at commit, or None without checksums —, whether its copy was deferred)."""

    def take_engine_for_commit(self, p: PendingSync) -> None:
        """Before the commit's apply, outside state_lock: get the engine gate unless already held."""

    @abstractmethod
    def apply(self, p: PendingSync) -> None:
        """At commit, under state_lock and holding the engine gate: load what is left, then flush."""

    @abstractmethod
    def release(self) -> None:
        """Let go of the engine gate if this strategy holds it (after a commit, an abort or a failure);
        the caller holds state_lock."""
