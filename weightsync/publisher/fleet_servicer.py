"""The fleet part of the Trainer gRPC service: registration, catch-up, sync and status.

Every publisher serves it (weightsync.publisher.Publisher directly, trainer-svc through its
TrainerServicer, which adds the admin and training RPCs); the RPCs it does not implement answer
UNIMPLEMENTED. `actor` is the weight source the orchestrator exports: this class reads its
`version`, `family`, `num_parameters()`, `describe_parallelism()` and, where it has one,
`publishable` (False: no tensors to send now, so no catch-up sync is started).
"""

from __future__ import annotations

import logging
import math
import queue
import threading

import grpc

from weightsync.bus.transports import transport as transport_named
from weightsync.config import ConfigError, parse_host_port
from weightsync.publisher.orchestrator import SyncInProgress, SyncOrchestrator
from weightsync.publisher.registry import RolloutRegistry
from weightsync.publisher.status_poll import poll_all
from weightsync.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


class FleetServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(
        self,
        actor,
        actor_lock: threading.Lock,
        registry: RolloutRegistry,
        orchestrator: SyncOrchestrator,
        backend: str,
        auto_sync: bool,
    ):
        self.actor = actor
        self.actor_lock = actor_lock
        self.registry = registry
        self.orch = orchestrator
        self.backend = backend
        self.auto_sync = auto_sync
        self._catchup: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._catchup_loop, name="catchup-sync", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        self._stop.set()
        self._catchup.put(None)

    # ---- fleet --------------------------------------------------------------------------
    def RegisterRollout(self, request, context):
        try:
            if not request.rollout_id:
                raise ConfigError("rollout_id is empty")
            parse_host_port("address", request.address)
            # a publisher declared by a dict of tensors has no family to compare: the manifest's names decide
            if request.model_family and self.actor.family and request.model_family != self.actor.family:
                raise ConfigError(
                    f"model_family: rollout serves {request.model_family!r}, trainer trains "
                    f"{self.actor.family!r}; start the rollout with the trainer's model"
                )
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        entry = self.registry.upsert(request.rollout_id, request.address, max(1, request.num_ranks))
        self.registry.poll(entry)
        behind = not self.orch.is_current(entry)
        # a source with nothing to send yet (a Publisher before its first sync) leaves it to the next sync
        scheduled = self.auto_sync and self.orch.needs_catch_up(entry) and self.actor.publishable
        if scheduled:
            self._catchup.put(request.rollout_id)
        log.info(
            "rollout %s registered at %s (version %d, trainer %d, catch-up %s)",
            request.rollout_id,
            request.address,
            entry.version,
            self.actor.version,
            scheduled,
        )
        return trainer_pb2.RegisterRolloutResponse(
            trainer_version=self.actor.version,
            sync_scheduled=scheduled,
            trainer_id=self.orch.trainer_id,
            current=not behind,
        )

    def DeregisterRollout(self, request, context):
        if not self.registry.remove(request.rollout_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"rollout_id {request.rollout_id!r} is not registered")
        return trainer_pb2.DeregisterRolloutResponse()

    def _catchup_loop(self) -> None:
        while not self._stop.is_set():
            rid = self._catchup.get()
            if rid is None:
                return
            entry = self.registry.get(rid)
            if entry is None or not self.orch.needs_catch_up(entry):
                continue
            try:
                # re-checked once it holds the sync lock: a sync running now may bring it up to date
                self.orch.sync([entry], wait_s=self.orch.sync_timeout, only_behind=True)
            except Exception as exc:  # logged and reported in status; the next registration retries
                entry.last_error = f"catch-up sync failed: {exc}"
                log.error("catch-up sync to %s failed: %s", rid, exc)

    # ---- sync ---------------------------------------------------------------------------
    def Sync(self, request, context):
        try:
            if not (math.isfinite(request.timeout_seconds) and 0 <= request.timeout_seconds <= 7 * 24 * 3600):
                raise ValueError(
                    f"timeout_seconds={request.timeout_seconds} must be finite and in [0, 604800] "
                    "(0 = the trainer's sync_timeout_s)"
                )
            if request.transport:
                transport_named(request.transport)  # ValueError naming the choices
            if request.senders not in ("", "all", "rank0"):
                raise ValueError(f"senders={request.senders!r} must be all or rank0 (or empty for the configured one)")
            targets = self.registry.select(list(request.rollout_ids))
            report = self.orch.sync(
                targets,
                request.transport,
                request.timeout_seconds,
                allow_rollback=request.allow_rollback,
                senders=request.senders,
                ipc_direction=request.ipc_direction,
            )
        except KeyError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except SyncInProgress as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        return trainer_pb2.SyncResponse(report=report)

    def GetSyncProgress(self, request, context):
        return self.orch.progress()

    def GetStatus(self, request, context):
        st = trainer_pb2.TrainerStatus(
            version=self.actor.version,
            model_family=self.actor.family,
            num_parameters=self.actor.num_parameters(),
            backend=self.backend,
            parallelism=self.actor.describe_parallelism(),
            sync_in_progress=self.orch.in_progress,
            origin=self.orch.origin,
            trainer_id=self.orch.trainer_id,
        )
        entries = self.registry.all()
        poll_all(self.registry, entries)  # at once, not in turn (status_poll.py)
        st.rollouts.extend(self.registry.info(e) for e in entries)
        st.last_sync.CopyFrom(self.orch.last_report)
        return st
