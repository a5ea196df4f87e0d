"""The trainer's end of TCP: every rollout answers PrepareSync with its bus address; buckets stream from host memory."""

from __future__ import annotations

import torch

from weightsync.bus.session import Sender, Session, kind_of
from weightsync.bus.tcp.wire import TcpBucketSender
from weightsync.v1 import bus_pb2


class TcpSender(Sender):
    name = "tcp"

    def __init__(self, token: str):
        self.token = token

    @classmethod
    def for_trainer(cls, side) -> "TcpSender":
        return cls(side.token)

    def begin(self, targets: list, sync_id: str, bucket_bytes: int) -> "_TcpSession":
        return _TcpSession(self.token, sync_id)


class _TcpSession(Session):
    name = "tcp"
    device = torch.device("cpu")

    def __init__(self, token: str, sync_id: str):
        self.token, self.sync_id = token, sync_id
        self._addresses: dict[str, str] = {}

    def spec_for(self, entry) -> bus_pb2.TransportSpec:
        spec = bus_pb2.TransportSpec()
        spec.tcp.SetInParent()
        return spec

    def accept(self, entry, resp) -> str:
        if kind_of(resp) != "tcp" or not resp.transport.tcp.data_address:
            return f"rollout answered a tcp prepare with transport {kind_of(resp)} and no data address"
        self._addresses[entry.rollout_id] = resp.transport.tcp.data_address
        return ""

    def data_address(self, rollout_id: str) -> str:
        """Where `rollout_id` takes bus connections (one per sender), as its PrepareSync answered."""
        return self._addresses[rollout_id]

    def open(self, targets: dict, timeout: float) -> TcpBucketSender:
        return TcpBucketSender(
            {rid: self._addresses[rid] for rid in targets}, self.sync_id, self.token, timeout=timeout
        )

    def owner_streams(self, prepared: dict, timeout: float, raise_flag) -> tuple[dict[str, str], None, float]:
        # every sender connects to each rollout's data port; a dead rollout breaks its own
        # connections, so there is no flag to watch
        return {rid: self._addresses[rid] for rid in prepared}, None, 1.0
