"""Registration with the trainer: retried with backoff until accepted or the deadline passes.

Re-registration is how a restarted rollout gets back to the latest version: the trainer answers
with its version and schedules a sync to it when it is behind.
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
    def __init__(self, trainer_address: str, token: str, request: trainer_pb2.RegisterRolloutRequest,
                 timeout: float, on_registered=None):
        self.trainer_address = trainer_address
        self.token = token
        self.request = request
        self.timeout = timeout
        self.registered = threading.Event()
        self.last_error = ""
        self._stop = threading.Event()
        self._on_registered = on_registered or (lambda resp: None)
        self._thread = threading.Thread(target=self._run, name="register", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else float("inf")
        delay = 0.2
        with channel(self.trainer_address) as ch:
            stub = trainer_stub(ch, self.token, timeout=10.0)
            while not self._stop.is_set():
                try:
                    resp = stub.RegisterRollout(self.request)
                    log.info("registered with trainer %s (trainer version %d, sync scheduled: %s)",
                             self.trainer_address, resp.trainer_version, resp.sync_scheduled)
                    self.registered.set()
                    self._on_registered(resp)
                    return
                except grpc.RpcError as exc:
                    self.last_error = describe_rpc_error(exc)
                    if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
                        log.error("trainer %s refused registration: %s", self.trainer_address, self.last_error)
                        return
                if time.monotonic() + delay > deadline:
                    log.error("could not register with trainer %s within %.0fs: %s", self.trainer_address,
                              self.timeout, self.last_error)
                    return
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
