"""A sending trainer rank's NCCL communicator in a multi-sender sync (any global rank, 0 included).

Global rank 0 plans one group per sending rank and hands each rank its group's unique id in the
SendJob (weightsync/publisher/multisender.py); the rank is rank 0 of that group and every rollout joins it
at the same rank as in the other senders' groups. The communicator lives in the sending rank's
process and is kept across syncs while rank 0 names the same group (`new_group` false). It is
dropped whenever its stream fails, because a failed collective leaves it aborted on some rank;
rank 0 then plans new groups for every sender, so a rank never has to report what it holds.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from weightsync.bus.errors import TransportError
from weightsync.bus.nccl.lazy_bus import LazyBus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderGroupJob:
    """What one sending rank needs to get its communicator (JSON-able in the SendJob)."""

    group_id: str
    unique_id: str  # hex of the ncclUniqueId
    new_group: bool
    world_size: int  # this sender + every receiving rank
    init_timeout: float  # seconds to build the communicator (every rollout must join within it)


class SenderGroupCache(LazyBus):
    def __init__(self, bus=None):
        self._bus = bus
        self._lock = threading.Lock()
        self._group = None
        self._group_id = ""
        self.builds = 0

    @property
    def group_id(self) -> str:
        return self._group_id

    def get(self, job: SenderGroupJob, device: torch.device, timeout: float):
        """This rank's communicator for `job`: built now (new_group) or the one it holds."""
        with self._lock:
            if not job.new_group:
                if self._group is not None and self._group_id == job.group_id and self._group.healthy:
                    return self._group
                raise TransportError(
                    f"nccl group {job.group_id} is not held by this rank (it holds "
                    f"{self._group_id or 'none'}): global rank 0 must plan a new group"
                )
            self._drop_locked(f"replaced by group {job.group_id}")
        # outside the lock: the join blocks until every rollout has joined too
        group = self.bus.open_group(
            bytes.fromhex(job.unique_id), job.world_size, 0, device, min(job.init_timeout, timeout)
        )
        with self._lock:
            self._group, self._group_id = group, job.group_id
            self.builds += 1
        log.info("NCCL sender group %s built: world size %d", job.group_id, job.world_size)
        return group

    def drop(self, reason: str) -> None:
        with self._lock:
            self._drop_locked(reason)

    def _drop_locked(self, reason: str) -> None:
        if self._group is not None:
            log.info("NCCL sender group %s dropped: %s", self._group_id, reason)
            self._group.abort(reason)
        self._group, self._group_id = None, ""
