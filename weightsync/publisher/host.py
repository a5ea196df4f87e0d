"""What every publisher runs around its weight source: listeners, metrics, the rollout registry,
the sync orchestrator and the fleet servicer.

Built in two steps so that a service can refuse an exposed, tokenless address before it loads a
model: `PublisherHost(...)` checks the exposure, binds gRPC and HTTP (serving starts at
`start()`), and creates the metrics and the registry; `publish(source, ...)` adds the orchestrator
over the source and the Trainer service (FleetServicer, or a subclass that adds RPCs, as
trainer-svc's TrainerServicer does). weightsync.publisher.Publisher and trainer-svc both use it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from weightsync.control.exposure import check_exposure
from weightsync.control.grpc_server import ServiceServer
from weightsync.http import serve_http
from weightsync.obs.metrics import AuthFailures, SyncMetrics, TrainerMetrics
from weightsync.publisher.fleet_servicer import FleetServicer
from weightsync.publisher.http_api import trainer_router
from weightsync.publisher.orchestrator import SyncOrchestrator
from weightsync.publisher.registry import RolloutRegistry
from weightsync.publisher.warm_up import warm_up
from weightsync.sync_options import SyncOptions
from weightsync.v1 import trainer_pb2_grpc

log = logging.getLogger(__name__)
#: the gRPC service a rollout's --trainer-address reaches
SERVICE_NAME = "weightsync.v1.Trainer"


class PublisherHost:
    def __init__(
        self,
        *,
        grpc_address: str,
        http_address: str,
        token: str,
        insecure: bool,
        prog: str,
        trainer_id: str = "",
        rpc_timeout_s: float = 30.0,
        ready: Callable[[], tuple[bool, str]] | None = None,
    ):
        self.token = token
        check_exposure({"grpc_address": grpc_address, "http_address": http_address}, token, insecure, prog)
        self.trainer_id = trainer_id or f"trainer-{uuid.uuid4().hex[:12]}"
        self.grpc = ServiceServer(grpc_address, token)
        self.metrics = SyncMetrics("trainer")
        self.trainer_metrics = TrainerMetrics(self.metrics.registry)
        AuthFailures("trainer", self.grpc.auth_failures, self.metrics.registry)
        self.http = serve_http(
            http_address,
            title=f"weightsync {prog}",
            registry=self.metrics.registry,
            ready=ready or self._readiness,
            token=token,
        )
        self.registry = RolloutRegistry(token, rpc_timeout_s)
        self.trainer_metrics.registered_rollouts.set_function(lambda: len(self.registry.all()))
        self.source = None
        self.orch: SyncOrchestrator | None = None
        self.servicer: FleetServicer | None = None
        self._started = False

    def _readiness(self) -> tuple[bool, str]:
        if self.source is None:
            return False, "no weight source yet"
        return True, f"weights at version {self.source.version}"

    def publish(
        self,
        source,
        source_lock: threading.Lock,
        *,
        options: SyncOptions,
        backend: str,
        auto_sync: bool,
        origin: str = "",
        make_servicer: Callable[..., FleetServicer] = FleetServicer,
    ) -> FleetServicer:
        """Publish `source` (a weightsync.publisher.source.WeightSource: trainer_svc/actor/base.py's
        actors, a Publisher's declared source), syncing as `options` say (weightsync/sync_options.py).
        `make_servicer(source, source_lock, registry, orchestrator, backend, auto_sync)` builds the Trainer servicer."""
        self.source = source
        self.metrics.version.set_function(lambda: source.version)
        self.orch = SyncOrchestrator(
            source,
            source_lock,
            self.registry,
            self.metrics,
            token=self.token,
            options=options,
            trainer_id=self.trainer_id,
            origin=origin,
        )
        warm_up(self.orch.device, source.export_metas(), self.orch.export_format.quantization is not None)
        self.servicer = make_servicer(source, source_lock, self.registry, self.orch, backend, auto_sync)
        trainer_pb2_grpc.add_TrainerServicer_to_server(self.servicer, self.grpc.server)
        self.http.include(trainer_router(self.servicer))
        return self.servicer

    def start(self) -> None:
        if self.servicer is None:
            raise RuntimeError("PublisherHost.start() before publish(): there is nothing to serve yet")
        self.grpc.start()
        self.http.start()
        self._started = True
        self.grpc.set_serving(SERVICE_NAME, True)

    def stop(self) -> None:
        """Stop serving; also releases the bound ports of a host that never started."""
        if self.servicer is not None:
            self.servicer.stop()
        if self._started:
            self.grpc.stop()
            self.http.stop()
            self._started = False
        else:
            self.grpc.server.stop(None)
            self.http.sock.close()
