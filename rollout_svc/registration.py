"""Registration with the trainer: retried with backoff, then repeated as a heartbeat.

Registration is idempotent. Repeating it every `heartbeat_s` is how a restarted trainer
rediscovers its fleet, and how a restarted rollout gets back to the latest version: the trainer
answers with its version and schedules a catch-up sync when the rollout is behind.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from weightsync.control.client import channel, describe_rpc_error, trainer_stub
from weightsync.v1 import trainer_pb2

log = logging.getLogger(__name__)


class Registrar:
    def __init__(
        self,
        trainer_address: str,
        token: str,
        request: trainer_pb2.RegisterRolloutRequest,
        timeout: float,
        heartbeat_s: float = 10.0,
        on_registered=None,
    ):
        self.trainer_address = trainer_address
        self.token = token
        self.request = request
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.registered = threading.Event()
        self.last_error = ""
        self._stop = threading.Event()
        self._on_registered = on_registered or (lambda resp: None)
        self._thread = threading.Thread(target=self._run, name="register", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def deregister(self, timeout: float = 3.0) -> str:
        """Tell the trainer this rollout is leaving; returns "" or the error (a shutdown must not hang on it)."""
        try:
            with channel(self.trainer_address) as ch:
                trainer_stub(ch, self.token, timeout=timeout).DeregisterRollout(
                    trainer_pb2.DeregisterRolloutRequest(rollout_id=self.request.rollout_id)
                )
            return ""
        except grpc.RpcError as exc:
            return describe_rpc_error(exc)

    def trainer_id(self, timeout: float = 5.0) -> str:
        """The id of the trainer at `trainer_address` now ("" when it cannot be asked)."""
        try:
            with channel(self.trainer_address) as ch:
                return (
                    trainer_stub(ch, self.token, timeout=timeout)
                    .GetStatus(trainer_pb2.TrainerStatusRequest())
                    .trainer_id
                )
        except grpc.RpcError as exc:
            log.warning("cannot ask trainer %s for its id: %s", self.trainer_address, describe_rpc_error(exc))
            return ""

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else float("inf")
        delay = 0.2
        with channel(self.trainer_address) as ch:
            stub = trainer_stub(ch, self.token, timeout=10.0)
            while not self._stop.is_set():
                try:
                    resp = stub.RegisterRollout(self.request)
                    if not self.registered.is_set() or resp.sync_scheduled:
                        log.info(
                            "registered with trainer %s (trainer version %d, catch-up sync: %s)",
                            self.trainer_address,
                            resp.trainer_version,
                            resp.sync_scheduled,
                        )
                    self.registered.set()
                    self.last_error = ""
                    self._on_registered(resp)
                    delay = 0.2
                    if self.heartbeat_s <= 0:
                        return
                    self._stop.wait(self.heartbeat_s)
                    continue
                except grpc.RpcError as exc:
                    self.last_error = describe_rpc_error(exc)
                    if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
                        log.error("trainer %s refused registration: %s", self.trainer_address, self.last_error)
                        return
                if not self.registered.is_set() and time.monotonic() + delay > deadline:
                    log.error(
                        "could not register with trainer %s within %.0fs: %s",
                        self.trainer_address,
                        self.timeout,
                        self.last_error,
                    )
                    return
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
