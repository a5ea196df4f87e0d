"""Assemble a running trainer-svc: actor, rollout registry, sync orchestrator, gRPC + HTTP.

Under torchrun, global rank 0 hosts the services and drives the actor; the other ranks only
follow its collective commands (`actor.worker_loop()`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid

from trainer_svc.actor.device import export_device
from trainer_svc.config import TrainerConfig
from trainer_svc.http_api import trainer_router
from trainer_svc.paths import DataRoots
from trainer_svc.service import TrainerServicer
from trainer_svc.warm_up import warm_up
from weightsync.control.auth import load_token
from weightsync.control.exposure import check_exposure
from weightsync.control.grpc_server import ServiceServer
from weightsync.http import serve_http
from weightsync.obs.metrics import SyncMetrics, TrainerMetrics
from weightsync.publisher import SyncOrchestrator
from weightsync.publisher.export_format import export_format
from weightsync.publisher.registry import RolloutRegistry
from weightsync.v1 import trainer_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "weightsync.v1.Trainer"


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class TrainerApp:
    def __init__(self, cfg: TrainerConfig, actor=None):
        self.cfg = cfg
        self.token = load_token(cfg.auth.auth_token, cfg.auth.auth_token_file)
        check_exposure(
            {"grpc_address": cfg.server.grpc_address, "http_address": cfg.server.http_address},
            self.token,
            cfg.auth.insecure,
            "trainer-svc",
        )
        self.trainer_id = cfg.fleet.trainer_id or f"trainer-{uuid.uuid4().hex[:12]}"
        self.grpc = ServiceServer(cfg.server.grpc_address, self.token)
        self.metrics = SyncMetrics("trainer")
        self.trainer_metrics = TrainerMetrics(self.metrics.registry)
        self.http = serve_http(
            cfg.server.http_address,
            title="weightsync trainer-svc",
            registry=self.metrics.registry,
            ready=self._readiness,
            token=self.token,
        )
        if actor is None:
            from trainer_svc.actor.factory import make_actor

            actor = make_actor(cfg)
        self.actor = actor
        self.actor_lock = threading.Lock()
        self.registry = RolloutRegistry(self.token, cfg.bus.rpc_timeout_s)
        self.trainer_metrics.registered_rollouts.set_function(lambda: len(self.registry.all()))
        self.metrics.version.set_function(lambda: self.actor.version)
        self.orch = SyncOrchestrator(
            self.actor,
            self.actor_lock,
            self.registry,
            self.metrics,
            token=self.token,
            bucket_bytes=cfg.bus.bucket_mb << 20,
            default_transport=cfg.bus.transport,
            sync_timeout=cfg.bus.sync_timeout_s,
            rpc_timeout=cfg.bus.rpc_timeout_s,
            origin=getattr(self.actor, "origin", "") or uuid.uuid4().hex[:16],
            device=export_device(self.actor),
            nccl_init_timeout=cfg.bus.nccl_init_timeout_s,
            on_nccl_group_build=self.metrics.nccl_group_builds.inc,
            export_format=export_format(cfg.actor.export_dtype),
            trainer_id=self.trainer_id,
            senders=cfg.bus.senders,
            sync_link=cfg.bus.sync_link,
            sync_encoding=cfg.bus.sync_encoding,
            delta_base_bytes=cfg.bus.delta_base_mb << 20,
        )
        warm_up(self.orch.device, self.actor.export_metas(), self.orch.export_format.quantization is not None)
        self.servicer = TrainerServicer(
            self.actor,
            self.actor_lock,
            self.registry,
            self.orch,
            cfg.actor.backend,
            cfg.fleet.auto_sync_new_rollouts,
            roots=DataRoots(cfg.checkpoint.data_root, cfg.checkpoint.checkpoint_dir),
        )
        trainer_pb2_grpc.add_TrainerServicer_to_server(self.servicer, self.grpc.server)
        self.http.include(trainer_router(self.servicer))
        # Applies --resume now, so a resumed trainer reports and publishes the checkpoint's version.
        self.servicer.init_training(cfg)
        for addr in cfg.fleet.rollouts:
            self.registry.upsert(addr, addr)
        self._stopped = threading.Event()

    def _readiness(self) -> tuple[bool, str]:
        return True, f"actor at version {self.actor.version}"

    def start(self) -> None:
        self.grpc.start()
        self.http.start()
        self.grpc.set_serving(SERVICE_NAME, True)
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
        self.servicer.stop()
        self.grpc.stop()
        self.http.stop()
        shutdown = getattr(self.actor, "shutdown", None)
        if shutdown:
            shutdown()

    def run_forever(self) -> None:
        self.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stopped.set())
        self._stopped.wait()
        self.stop()
