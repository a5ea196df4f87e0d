"""Assemble a running rollout-svc: engine, sync transaction, gRPC + TCP bus + HTTP, registration."""

from __future__ import annotations

import logging
import signal
import threading

from rollout_svc.config import RolloutConfig
from rollout_svc.metered import metered_generate
from rollout_svc.openai_api import Served, rollout_router
from rollout_svc.quantized import warm_dequantize as fp8_dequantize_warm_up
from rollout_svc.registration import Registrar
from rollout_svc.service import RolloutServicer
from rollout_svc.sync.link_server import SyncLinkServer
from rollout_svc.sync.pinning import TrainerPin
from rollout_svc.sync.transaction import SyncTransaction
from weightsync import debug
from weightsync.bus.copy.checksum import warm_up as bucket_checksum_warm_up
from weightsync.bus.tcp.receiver import TcpReceiver
from weightsync.config import ConfigError
from weightsync.control.auth import load_token
from weightsync.control.exposure import check_exposure
from weightsync.control.grpc_server import ServiceServer
from weightsync.control.sync_link import LINK_MAGIC, LINK_MAGIC_BEATS
from weightsync.http import serve_http
from weightsync.model_spec import family_of
from weightsync.obs import logs, tracing
from weightsync.obs.metrics import AuthFailures, SyncMetrics
from weightsync.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2

log = logging.getLogger(__name__)
SERVICE_NAME = "weightsync.v1.Rollout"
#: what the generation key grants over gRPC (it grants the OpenAI routes over HTTP)
GENERATION_METHODS = (f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/Score")


class RolloutApp:
    def __init__(self, cfg: RolloutConfig):
        self.cfg = cfg
        debug.configure(cfg.debug.switches())  # in-process apps (tests) too: the CLI did so already
        token, generation_key = self._tokens(cfg)
        # Bind every port before the (slow) engine load so a port clash fails in milliseconds.
        self.grpc = ServiceServer(cfg.server.grpc_address, token, scoped_tokens=((generation_key, GENERATION_METHODS),))
        self.metrics = SyncMetrics("rollout")
        AuthFailures("rollout", self.grpc.auth_failures, self.metrics.registry)
        self._ready = False
        self.http = serve_http(
            cfg.server.http_address,
            title="weightsync rollout-svc",
            registry=self.metrics.registry,
            ready=self._readiness,
            token=token,
            scoped_tokens=((generation_key, ("/v1/",)),),  # every /v1/ route here is the OpenAI surface
        )
        from rollout_svc.engine.factory import make_engine

        self.engine = make_engine(cfg)
        self.tx = SyncTransaction(
            self.engine, cfg.bus.apply_mode, on_change=lambda: self.servicer.refresh_state_metric()
        )
        self.tx.delta_base.enabled = cfg.bus.delta_base
        self.data = TcpReceiver(
            cfg.bus.data_address,
            self.tx,
            token,
            max_connections=cfg.limits.max_bus_connections,
            delta_base=self.tx.delta_base,
        )
        advertise = cfg.registration.advertise_address or self.grpc.address
        self.rollout_id = cfg.registration.rollout_id or advertise
        self.registrar = None
        reg = cfg.registration
        self.pin = TrainerPin(reg.trainer_id, reg.trainer_address, ask_trainer=lambda: self.registrar.trainer_id())
        self._serve_rpcs(cfg, token)
        self._serve_openai(cfg)
        self._warm_up()
        if reg.trainer_address:
            req = trainer_pb2.RegisterRolloutRequest(
                rollout_id=self.rollout_id,
                address=advertise,
                num_ranks=self.engine.num_ranks(),
                model_family=self.servicer.family,
            )
            self.registrar = Registrar(
                reg.trainer_address, token, req, reg.register_timeout_s, reg.heartbeat_s, on_registered=self._registered
            )
        self._stopped = threading.Event()

    @staticmethod
    def _tokens(cfg: RolloutConfig) -> tuple[str, str]:
        """(admin token, generation key), after the exposure check: a listener beyond loopback needs a token."""
        token = load_token(cfg.auth.auth_token, cfg.auth.auth_token_file)
        generation_key = load_token(
            cfg.auth.generation_token, cfg.auth.generation_token_file, field="generation_token_file"
        )
        if generation_key and generation_key == token:
            raise ConfigError("generation_token: must differ from auth_token (the admin token grants everything)")
        check_exposure(
            {
                "grpc_address": cfg.server.grpc_address,
                "http_address": cfg.server.http_address,
                "data_address": cfg.bus.data_address,
            },
            token,
            cfg.auth.insecure,
            "rollout-svc",
        )
        return token, generation_key

    def _serve_rpcs(self, cfg: RolloutConfig, token: str) -> None:
        """The Rollout gRPC service and its sync link on the data port."""
        reg = cfg.registration
        self.servicer = RolloutServicer(
            self.rollout_id,
            self.engine,
            self.tx,
            self.metrics,
            cfg.inference.engine,
            family_of(self.engine.hf_config()),
            f"{cfg.bus.advertise_data_host or self.data.host}:{self.data.port}",
            cfg.bus.sync_timeout_s,
            limits=cfg.limits,
            pin=self.pin,
            serve_initial_weights=reg.serve_initial_weights,
        )
        # A manifest can be no larger than this model's: refuse bigger PrepareSync requests unparsed.
        self.grpc.request_limits["/weightsync.v1.Rollout/PrepareSync"] = self.servicer.manifest_limits.max_request_bytes
        # gRPC Generate timed and counted per request; servicer.generate (shared with HTTP) stays unmetered
        self.servicer.Generate = metered_generate(self.servicer.Generate, self.servicer.rollout_metrics)
        tracing.traced_sync_handlers(self.servicer)  # spans continuing the trainer's trace (when on)
        logs.process_fields(rollout_id=self.rollout_id)
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.servicer, self.grpc.server)
        self.link = SyncLinkServer(self.servicer, token, self.grpc.request_limits, cfg.limits.max_sync_links)
        if cfg.bus.sync_link:
            self.data.other_protocols[LINK_MAGIC] = self.link.serve
            self.data.other_protocols[LINK_MAGIC_BEATS] = self.link.serve_with_beats
            self.servicer.sync_link = self.servicer.data_address

    def _serve_openai(self, cfg: RolloutConfig) -> None:
        hf = self.engine.hf_config()
        served = Served(
            cfg.inference.model,
            version=lambda: self.tx.version,
            max_new_tokens=cfg.limits.max_new_tokens,
            context_length=getattr(hf, "max_position_embeddings", None),
        )
        self.http.include(rollout_router(self.servicer, served))

    def _warm_up(self) -> None:
        # The first checksum on a GPU compiles its kernel (about a second): pay it before serving.
        warm = bucket_checksum_warm_up(self.servicer.device)
        if warm:
            log.info("checksum kernel ready on %s in %.2fs", self.servicer.device, warm)
        warm = fp8_dequantize_warm_up(self.engine, self.servicer.device)
        if warm:
            log.info("FP8 dequantize kernel ready on %s in %.2fs", self.servicer.device, warm)

    def _registered(self, resp) -> None:
        self.pin.learn(resp.trainer_id, f"the trainer at {self.cfg.registration.trainer_address}")
        if resp.current and resp.trainer_id == self.pin.pinned:
            self.servicer.current = True

    def _readiness(self) -> tuple[bool, str]:
        if not self._ready:
            return False, "engine loading"
        if self.tx.state == rollout_pb2.STALE:
            return False, f"STALE: {self.tx.last_error}"
        if self.tx.memory_released:  # colocated: the trainer holds the GPU until the next sync commits
            return (
                False,
                "GPU memory released for a colocated train step (ReleaseMemory); ready again once a sync commits",
            )
        if not self.servicer.current:
            # A (re)started rollout holds its own initial weights: not the trainer's. It becomes ready
            # when the catch-up sync commits, so a Service never routes to weights nobody trained.
            return False, (
                "not current: waiting for a sync from the trainer (serving initial weights, version "
                f"{self.tx.version}); --serve-initial-weights serves them without one"
            )
        return True, f"serving version {self.tx.version}"

    def start(self) -> None:
        self.grpc.start()
        self.data.start()
        self.http.start()
        self._ready = True
        self.grpc.set_serving(SERVICE_NAME, True)
        if self.registrar:
            self.registrar.start()
        log.info(
            "rollout %s serving: grpc %s, bus tcp %s:%d, http :%d, engine %s",
            self.rollout_id,
            self.grpc.address,
            self.data.host,
            self.data.port,
            self.http.port,
            self.cfg.inference.engine,
        )

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        pending = self.tx.pending_sync_id
        if pending:
            # Abort rather than finish: the trainer may be gone, and a commit after this point
            # would race the gRPC server's shutdown. Staged engines keep their version.
            self.tx.abort(pending, "rollout shutting down")
            self.servicer.nccl.abort(pending, "rollout shutting down")
        if self.registrar:
            self.registrar.stop()
            err = self.registrar.deregister()
            log.info(
                "rollout %s shutting down: %s; deregistered from trainer %s%s",
                self.rollout_id,
                f"aborted pending sync {pending}" if pending else "no sync in flight",
                self.cfg.registration.trainer_address,
                f" FAILED ({err})" if err else "",
            )
        else:
            log.info(
                "rollout %s shutting down: %s",
                self.rollout_id,
                f"aborted pending sync {pending}" if pending else "no sync in flight",
            )
        self.grpc.stop()
        self.data.stop()
        self.link.stop()
        self.http.stop()
        self.servicer.nccl.close()

    def run_forever(self) -> None:
        self.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stopped.set())
        self._stopped.wait()
        self._stopped.clear()
        self.stop()
