"""The Trainer gRPC servicer of trainer-svc: the publisher's fleet part (registration, sync, status),
plus the admin calls behind wsctl (load, export) and the training RPCs."""

from __future__ import annotations

import logging
import threading

import grpc

from trainer_svc.paths import DataRoots, PathRefused
from trainer_svc.train.rpc import TrainingServicerMixin
from weightsync.publisher import FleetServicer, RolloutRegistry, SyncOrchestrator
from weightsync.v1 import trainer_pb2

log = logging.getLogger(__name__)


class TrainerServicer(TrainingServicerMixin, FleetServicer):
    def __init__(
        self,
        actor,
        actor_lock: threading.Lock,
        registry: RolloutRegistry,
        orchestrator: SyncOrchestrator,
        backend: str,
        auto_sync: bool,
        roots: DataRoots | None = None,
    ):
        super().__init__(actor, actor_lock, registry, orchestrator, backend, auto_sync)
        self.roots = roots or DataRoots()

    # ---- admin --------------------------------------------------------------------------
    def _resolve(self, context, field: str, path: str) -> str:
        try:
            return self.roots.resolve(field, path)
        except PathRefused as exc:
            log.warning("refused %s: %s", field, exc)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def LoadWeights(self, request, context):
        hf_path = self._resolve(context, "hf_path", request.hf_path)
        if not self.actor_lock.acquire(timeout=60):
            context.abort(grpc.StatusCode.ABORTED, "a sync is running; retry when it finishes")
        try:
            self.actor.load_hf(hf_path)
            self.orch.metrics.version.set(self.actor.version)
        except (ValueError, OSError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"load_weights: {exc}")
        finally:
            self.actor_lock.release()
        return trainer_pb2.LoadWeightsResponse(version=self.actor.version, hf_path=hf_path)

    def ExportHf(self, request, context):
        out_dir = self._resolve(context, "out_dir", request.out_dir)
        if not self.actor_lock.acquire(timeout=60):
            context.abort(grpc.StatusCode.ABORTED, "a sync is running; retry when it finishes")
        try:
            from trainer_svc.export_hf import save_hf_dir

            n = save_hf_dir(self.actor, out_dir, self.orch.export_format)
        except (ValueError, OSError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"export_hf: {exc}")
        finally:
            self.actor_lock.release()
        return trainer_pb2.ExportHfResponse(out_dir=out_dir, version=self.actor.version, num_tensors=n)
