"""Watch the members of an NCCL group while a stream runs, and abort the group when one dies.

A broadcast needs every rank: if a rollout process dies mid-stream, real NCCL leaves the trainer
(and every other rollout) waiting until the sync's timeout, minutes by default. The control
plane sees the death at once — its gRPC port refuses connections — so a watcher asks every
member for its status once per period and aborts the communicator on the first UNAVAILABLE,
which ends every rank's wait within about a period. Slow or busy answers are not deaths: only
a refused or reset connection counts (the stream's own timeout still bounds a hung member).
"""
from __future__ import annotations

import logging
import threading

from weightsync.bus.session import RpcCall
from weightsync.v1 import rollout_pb2

log = logging.getLogger(__name__)


class GroupWatch:
    def __init__(self, group, members: dict, call: RpcCall, period: float):
        self.group, self.members, self.call, self.period = group, dict(members), call, period
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a verdict is given before stop() returns, or never
        self.tripped = ""
        self._thread = threading.Thread(target=self._run, name="nccl-liveness", daemon=True)

    def start(self) -> "GroupWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; returns at once (a status call in flight is left to finish and ignored)."""
        with self._lock:
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for rid, entry in self.members.items():
                if self._stop.is_set():
                    return
                _, err = self.call(entry, "GetStatus", rollout_pb2.GetStatusRequest())
                if not err.startswith("UNAVAILABLE"):
                    continue
                with self._lock:
                    if self._stop.is_set():
                        return  # the stream ended first: the group is fine, keep it
                    self.tripped = f"rollout {rid} became unreachable during the stream ({err})"
                log.warning("NCCL group aborted: %s", self.tripped)
                self.group.abort(self.tripped)
                return
