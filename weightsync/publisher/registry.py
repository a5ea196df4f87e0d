"""The trainer's view of the rollout fleet: who is registered, where, and at which version."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from weightsync.control.client import channel, describe_rpc_error, rollout_stub
from weightsync.publisher.link_client import SyncLinkClient
from weightsync.v1 import rollout_pb2, trainer_pb2


@dataclass
class RolloutEntry:
    rollout_id: str
    address: str
    num_ranks: int = 1
    version: int = 0
    origin: str = ""
    #: the trainer id the rollout follows, as its status says ("" before it follows one)
    trainer_id: str = ""
    state: int = rollout_pb2.ENGINE_STATE_UNSPECIFIED
    reachable: bool = False
    last_error: str = ""
    last_sync_seconds: float = 0.0
    registered_at: float = field(default_factory=time.time)
    _channel: grpc.Channel | None = None
    #: the rollout reads run entries in a full manifest (its last status or PrepareSync answer said so);
    #: False until it says so, so a rollout that predates them is sent every tensor as its own entry
    manifest_runs: bool = False
    #: its engine's GPU memory is released for a colocated train step (its last status said so): not caught up
    memory_released: bool = False
    #: the sync link this rollout offered in its last PrepareSync answer (weightsync.publisher.link_client)
    link: SyncLinkClient | None = None

    def stub(self, token: str, timeout: float):
        if self._channel is None:
            self._channel = channel(self.address)
        return rollout_stub(self._channel, token, timeout)

    def offer_link(self, address: str, token: str) -> None:
        """The rollout's answer named its sync link ("" for none): keep the open one if unchanged."""
        if self.link is not None and self.link.address == address:
            return
        if self.link is not None:
            self.link.close()
        self.link = SyncLinkClient(address, token) if address else None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.link is not None:
            self.link.close()
            self.link = None


class RolloutRegistry:
    def __init__(self, token: str, rpc_timeout: float):
        self.token = token
        self.rpc_timeout = rpc_timeout
        self._entries: dict[str, RolloutEntry] = {}
        self._lock = threading.Lock()

    def upsert(self, rollout_id: str, address: str, num_ranks: int = 1) -> RolloutEntry:
        with self._lock:
            old = self._entries.get(rollout_id)
            if old is not None and old.address == address:
                old.num_ranks = num_ranks
                return old
            if old is not None:
                old.close()
            entry = RolloutEntry(rollout_id, address, num_ranks)
            self._entries[rollout_id] = entry
            return entry

    def remove(self, rollout_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(rollout_id, None)
        if entry:
            entry.close()
        return entry is not None

    def get(self, rollout_id: str) -> RolloutEntry | None:
        with self._lock:
            return self._entries.get(rollout_id)

    def all(self) -> list[RolloutEntry]:
        with self._lock:
            return list(self._entries.values())

    def select(self, ids: list[str]) -> list[RolloutEntry]:
        if not ids:
            return self.all()
        out = []
        for rid in ids:
            e = self.get(rid)
            if e is None:
                raise KeyError(f"rollout_ids: {rid!r} is not registered (known: {[x.rollout_id for x in self.all()]})")
            out.append(e)
        return out

    def poll(self, entry: RolloutEntry) -> None:
        try:
            st = entry.stub(self.token, min(self.rpc_timeout, 5.0)).GetStatus(rollout_pb2.GetStatusRequest())
            entry.version, entry.origin, entry.state, entry.reachable = st.version, st.origin, st.state, True
            entry.trainer_id = st.trainer_id
            entry.manifest_runs = st.manifest_runs
            entry.memory_released = st.memory_released
            if st.last_error:
                entry.last_error = st.last_error
        except grpc.RpcError as exc:
            entry.reachable = False
            entry.last_error = describe_rpc_error(exc)

    def info(self, entry: RolloutEntry) -> trainer_pb2.RolloutInfo:
        return trainer_pb2.RolloutInfo(
            rollout_id=entry.rollout_id,
            address=entry.address,
            version=entry.version,
            state=entry.state,
            reachable=entry.reachable,
            last_error=entry.last_error,
            last_sync_seconds=entry.last_sync_seconds,
            origin=entry.origin,
        )
