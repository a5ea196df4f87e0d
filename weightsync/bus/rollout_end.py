"""The contract between the rollout's PrepareSync and a transport's rollout end.

Each transport's rollout end (tcp/receiver.py, nccl/receiver.py, ipc/receiver.py) is built once
per rollout from the registry (weightsync.bus.transports). PrepareSync asks the end the request
names whether this rollout can take the sync and what to answer about the transport, prepares
the sync transaction, then has the end receive; the rollout never branches on the transport.
"""

from __future__ import annotations

from weightsync.bus.plan import Manifest
from weightsync.bus.transports import RolloutSide
from weightsync.v1 import bus_pb2, rollout_pb2


class RolloutEnd:
    name: str = ""

    @classmethod
    def for_rollout(cls, side: RolloutSide) -> "RolloutEnd":
        """This end as a rollout builds it."""
        raise NotImplementedError

    def prepare(self, spec: bus_pb2.TransportSpec, manifest: Manifest, resp: rollout_pb2.PrepareSyncResponse) -> None:
        """Before the sync transaction is prepared: SyncError (weightsync.bus.errors) when this
        rollout cannot take the sync, else what the answer says of the transport (`resp.transport`)."""
        raise NotImplementedError

    def receive(
        self, manifest: Manifest, spec: bus_pb2.TransportSpec, deadline: float, resp: rollout_pb2.PrepareSyncResponse
    ) -> None:
        """The transaction is prepared (and `resp` filled by `prepare`): take this sync's buckets."""

    def supersede(self, reason: str) -> None:
        """A sync over another transport was prepared: let go of any earlier sync still waiting here."""
