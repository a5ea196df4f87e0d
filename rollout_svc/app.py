"""Assemble a running rollout-svc: engine, sync transaction, gRPC + TCP bus + HTTP, registration."""
from __future__ import annotations

import logging
import signal
import threading

from rollout_svc.config import RolloutConfig
from rollout_svc.registration import Registrar
from rollout_svc.service import RolloutServicer
from rollout_svc.transaction import SyncTransaction
from weightsync.bus.tcp.receiver import TcpReceiver
from weightsync.control.auth import load_token
from weightsync.control.grpc_server import ServiceServer
from weightsync.model_spec import family_of
from weightsync.obs.http import HttpEndpoints
from weightsync.obs.metrics import SyncMetrics
from weightsync.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2

log = logging.getLogger(__name__)
SERVICE_NAME = "weightsync.v1.Rollout"


class RolloutApp:
    def __init__(self, cfg: RolloutConfig):
        self.cfg = cfg
        token = load_token(cfg.auth.auth_token, cfg.auth.auth_token_file)
        # Bind every port before the (slow) engine load so a port clash fails in milliseconds.
        self.grpc = ServiceServer(cfg.server.grpc_address, token)
        self.metrics = SyncMetrics("rollout")
        self._ready = False
        self.http = HttpEndpoints(cfg.server.http_address, self.metrics.registry, self._readiness)
        from rollout_svc.engine.factory import make_engine

        self.engine = make_engine(cfg)
        self.tx = SyncTransaction(self.engine, cfg.bus.apply_mode, on_change=lambda: self.servicer.refresh_state_metric())
        self.data = TcpReceiver(cfg.bus.data_address, self.tx, token)
        data_host = cfg.bus.advertise_data_host or self.data.host
        advertise = cfg.registration.advertise_address or self.grpc.address
        self.rollout_id = cfg.registration.rollout_id or advertise
        self.servicer = RolloutServicer(self.rollout_id, self.engine, self.tx, self.metrics, cfg.inference.engine,
                                        family_of(self.engine.hf_config()) if hasattr(self.engine, "hf_config") else "",
                                        f"{data_host}:{self.data.port}", cfg.bus.sync_timeout_s)
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.servicer, self.grpc.server)
        self.registrar = None
        if cfg.registration.trainer_address:
            req = trainer_pb2.RegisterRolloutRequest(rollout_id=self.rollout_id, address=advertise,
                                                     num_ranks=self.engine.num_ranks(),
                                                     model_family=self.servicer.family)
            self.registrar = Registrar(cfg.registration.trainer_address, token, req, cfg.registration.register_timeout_s, cfg.registration.heartbeat_s)
        self._stopped = threading.Event()

    def _readiness(self) -> tuple[bool, str]:
        if not self._ready:
            return False, "engine loading"
        if self.tx.state == rollout_pb2.STALE:
            return False, f"STALE: {self.tx.last_error}"
        return True, f"serving version {self.tx.version}"

    def start(self) -> None:
        self.grpc.start()
        self.data.start()
        self.http.start()
        self._ready = True
        self.grpc.set_serving(SERVICE_NAME, True)
        if self.registrar:
            self.registrar.start()
        log.info("rollout %s serving: grpc %s, bus tcp %s:%d, http :%d, engine %s", self.rollout_id, self.grpc.address,
                 self.data.host, self.data.port, self.http.port, self.cfg.inference.engine)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.registrar:
            self.registrar.stop()
        self.grpc.stop()
        self.data.stop()
        self.http.stop()
        self.servicer.nccl.close()

    def run_forever(self) -> None:
        self.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stopped.set())
        self._stopped.wait()
        self._stopped.clear()
        self.stop()
