"""Real libnccl with a hold before a chosen bucket of the trainer's stream (GPU tests only).

A GPU stream of a test model lasts milliseconds: a test that must stop or kill a rollout while the
broadcasts run cannot race it. This bus is weightsync.bus.nccl.group.CudaNcclBus (real communicators,
real ncclCommAbort) whose trainer sender waits before the WS_NCCL_HOLD_AT-th bucket of each stream
(default 3) while the file WS_NCCL_HOLD exists, saying so by creating <file>.held; the test then acts
(SIGSTOP, kill -9) and removes the file. Selected with the debug switch
nccl_bus=tests.support.held_nccl:HeldCudaNcclBus (env WS_TRAINER_NCCL_BUS) in processes that have the
repository root on their path. The same hold for the gloo stand-in on CPU: tests/support/gloo_nccl.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from weightsync.bus.nccl.group import CudaNcclBus, NcclBucketSender

_HOLD_LIMIT_S = 300.0


class HeldSender(NcclBucketSender):
    def __init__(self, group):
        super().__init__(group)
        path = os.environ.get("WS_NCCL_HOLD", "")
        self._hold = Path(path) if path else None
        self._hold_at = int(os.environ.get("WS_NCCL_HOLD_AT", "3"))
        self._sent = 0

    def send(self, plan, buf, checksum) -> None:
        self._sent += 1
        if self._hold is not None and self._sent >= self._hold_at and self._hold.exists():
            Path(f"{self._hold}.held").touch()
            deadline = time.monotonic() + _HOLD_LIMIT_S
            while self._hold.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        super().send(plan, buf, checksum)


class HeldCudaNcclBus(CudaNcclBus):
    def sender(self, group) -> HeldSender:
        return HeldSender(group)
