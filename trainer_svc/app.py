"""Assemble a running trainer-svc: its actor published through weightsync.publisher, plus its admin and training RPCs.

The listeners, registry, orchestrator and the fleet RPCs (registration, sync, status) are the
publisher's (weightsync/publisher/host.py); trainer-svc adds the actor and TrainerServicer's admin
and training RPCs. Under torchrun, global rank 0 hosts the services and drives the actor; the
other ranks only follow its collective commands (`actor.worker_loop()`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from trainer_svc.actor.device import export_device
from trainer_svc.config import TrainerConfig
from trainer_svc.paths import DataRoots
from trainer_svc.service import TrainerServicer
from weightsync import debug
from weightsync.control.auth import load_token
from weightsync.publisher import PublisherHost

log = logging.getLogger(__name__)


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class TrainerApp:
    def __init__(self, cfg: TrainerConfig, actor=None):
        self.cfg = cfg
        debug.configure(cfg.debug.switches())  # in-process apps (tests) too: the CLI did so already
        self.token = load_token(cfg.auth.auth_token, cfg.auth.auth_token_file)
        # refuses an exposed address without a token before the model is built
        self.host = PublisherHost(
            grpc_address=cfg.server.grpc_address,
            http_address=cfg.server.http_address,
            token=self.token,
            insecure=cfg.auth.insecure,
            prog="trainer-svc",
            trainer_id=cfg.fleet.trainer_id,
            rpc_timeout_s=cfg.bus.rpc_timeout_s,
            ready=self._readiness,
        )
        self.trainer_id = self.host.trainer_id
        self.grpc, self.http, self.registry = self.host.grpc, self.host.http, self.host.registry
        self.metrics, self.trainer_metrics = self.host.metrics, self.host.trainer_metrics
        if actor is None:
            from trainer_svc.actor.factory import make_actor

            actor = make_actor(cfg)
        self.actor = actor
        self.actor_lock = threading.Lock()
        roots = DataRoots(cfg.checkpoint.data_root, cfg.checkpoint.checkpoint_dir)
        self.servicer = self.host.publish(
            self.actor,
            self.actor_lock,
            options=cfg.bus.sync_options(cfg.actor.export_dtype, str(export_device(self.actor))),
            backend=cfg.actor.backend,
            auto_sync=cfg.fleet.auto_sync_new_rollouts,
            origin=getattr(self.actor, "origin", ""),
            make_servicer=lambda *args: TrainerServicer(*args, roots=roots),
        )
        self.orch = self.host.orch
        # Applies --resume now, so a resumed trainer reports and publishes the checkpoint's version.
        self.servicer.init_training(cfg)
        for addr in cfg.fleet.rollouts:
            self.registry.upsert(addr, addr)
        self._stopped = threading.Event()

    def _readiness(self) -> tuple[bool, str]:
        return True, f"actor at version {self.actor.version}"

    def start(self) -> None:
        self.host.start()
        log.info(
            "trainer %s serving: grpc %s, http :%d, backend %s (%s), version %d, data_root %s",
            self.trainer_id,
            self.grpc.address,
            self.http.port,
            self.cfg.actor.backend,
            self.actor.describe_parallelism(),
            self.actor.version,
            self.servicer.roots.data_root,
        )

    def stop(self) -> None:
        self.host.stop()
        shutdown = getattr(self.actor, "shutdown", None)
        if shutdown:
            shutdown()

    def run_forever(self) -> None:
        self.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stopped.set())
        self._stopped.wait()
        self.stop()
