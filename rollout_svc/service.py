"""The Rollout gRPC servicer: maps RPCs onto the engine and the sync transaction."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import grpc

from rollout_svc.engine.base import Emit, SamplingParams
from rollout_svc.limits import Admission, LimitsConfig, ManifestLimits, RequestRefused, check_generate
from rollout_svc.sync.engine_gate import Lend, no_lend
from rollout_svc.sync.pinning import TrainerPin
from rollout_svc.sync.transaction import SyncTransaction
from weightsync.bus.errors import SyncError
from weightsync.bus.layout import KnownLayouts
from weightsync.bus.transports import TRANSPORTS, RolloutSide, choices, multi_sender_names
from weightsync.obs.metrics import RolloutMetrics, SyncMetrics
from weightsync.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

_SERVE_WAIT_S = 60.0
_MAX_SYNC_TIMEOUT_S = 7 * 24 * 3600.0
#: ReleaseMemory waits at most this long for running requests
_MAX_RELEASE_WAIT_S = 600.0
#: the engine states the state metric has a series for (the proto's 0, unset, is never a state)
_STATE_NAMES = tuple(name for name, num in rollout_pb2.EngineState.items() if num)


def _after_answer(context, fn: Callable[[], None]) -> None:
    """`fn()` once the call's answer went out (gRPC and the sync link run a call's callbacks then), else now.

    A sync's log lines at INFO cost their formatting and write, inside the PrepareSync and CommitSync
    round trips the trainer waits on (a fifth of either handler's time on a CPU): they are written after."""
    if context is None or not context.add_callback(fn):
        fn()


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    code = getattr(grpc.StatusCode, getattr(exc, "code", "INVALID_ARGUMENT"), grpc.StatusCode.INVALID_ARGUMENT)
    context.abort(code, str(exc))


class GenerationCancelled(SyncError):
    """The client of a generation went away (gRPC cancel or deadline, HTTP disconnect)."""


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(
        self,
        rollout_id: str,
        engine,
        tx: SyncTransaction,
        metrics: SyncMetrics,
        engine_name: str,
        family: str,
        data_address: str,
        sync_timeout: float,
        limits: LimitsConfig | None = None,
        pin: TrainerPin | None = None,
        serve_initial_weights: bool = False,
    ):
        self.rollout_id = rollout_id
        self.engine = engine
        self.tx = tx
        self.metrics = metrics
        self.engine_name = engine_name
        self.family = family
        self.data_address = data_address
        self.sync_timeout = sync_timeout
        self.rollout_metrics = RolloutMetrics(metrics.registry)
        self._sync_started: dict[str, float] = {}
        self.limits = limits or LimitsConfig()
        self.admission = Admission(self.limits.max_inflight_requests, self.limits.max_inflight_per_client)
        self.manifest_limits = ManifestLimits(engine.param_metas(), self.limits.max_bucket_mb)
        self.pin = pin or TrainerPin()
        #: sync_id -> (trainer id that prepared it, is an allowed rollback)
        self._sync_origin: dict[str, tuple[str, bool]] = {}
        #: True once a sync from the trainer committed (or the operator opted into the initial weights)
        self.current = serve_initial_weights
        self._lock = threading.Lock()
        self.device = engine.receive_device()
        side = RolloutSide(
            tx,
            self.device,
            engine_name,
            data_address,
            self.limits.max_bus_connections,
            options={
                "nccl": {"on_build": metrics.nccl_group_builds.inc},
                "ipc": {"on_open": self.rollout_metrics.ipc_opens.inc},
            },
        )
        #: transport name -> its rollout end (weightsync.bus.transports), which takes part in PrepareSync
        self.ends = {t.name: t.rollout_end_class().for_rollout(side) for t in TRANSPORTS.values()}
        self.nccl, self.ipc = self.ends["nccl"], self.ends["ipc"]  # for their own RPCs (AbortSync, IpcBuckets)
        self.rollout_metrics.ipc_mappings.set_function(lambda: len(self.ipc.maps))
        self.layouts = KnownLayouts()  # validated manifests by layout digest: later prepares send the digest
        #: said in the status and every PrepareSync answer: this rollout reads run entries (weightsync.bus.runs);
        #: a test sets it False to stand for a build that predates them
        self.manifest_runs = True
        #: host:port of the sync link (rollout_svc.sync.link_server) this rollout offers, "" for none
        self.sync_link = ""
        self.refresh_state_metric()

    def refresh_state_metric(self) -> None:
        self.rollout_metrics.show_state(rollout_pb2.EngineState.Name(self.tx.state), _STATE_NAMES)
        self.metrics.version.set(self.tx.version)
        self.metrics.in_progress.set(1 if self.tx.pending_sync_id else 0)
        self.rollout_metrics.memory_released.set(1 if self.tx.memory_released else 0)

    def status(self) -> rollout_pb2.RolloutStatus:
        return rollout_pb2.RolloutStatus(
            rollout_id=self.rollout_id,
            state=self.tx.state,
            version=self.tx.version,
            weights_checksum=self.tx.weights_checksum,
            engine=self.engine_name,
            model_family=self.family,
            num_parameters=self.engine.num_parameters(),
            num_ranks=self.engine.num_ranks(),
            pending_sync_id=self.tx.pending_sync_id,
            last_error=self.tx.last_error,
            last_apply_seconds=self.tx.last_apply_seconds,
            prefix_cache_entries=self.engine.prefix_cache_entries(),
            origin=self.tx.origin,
            trainer_id=self.pin.pinned,
            current=self.current,
            manifest_runs=self.manifest_runs,
            memory_released=self.tx.memory_released,
        )

    # ---- serving ------------------------------------------------------------------------
    def _refused(self, exc: RequestRefused) -> None:
        self.rollout_metrics.refused.labels("rollout", "busy" if exc.code == "RESOURCE_EXHAUSTED" else "budget").inc()

    def GetStatus(self, request, context):
        return self.status()

    def Generate(self, request, context):
        try:
            if not request.prompts:
                raise ValueError("prompts: need at least 1 prompt, got 0")
            s = request.sampling
            sampling = SamplingParams(
                max_new_tokens=s.max_new_tokens or 16,
                temperature=s.temperature,
                top_p=s.top_p or 1.0,
                top_k=s.top_k,
                seed=s.seed,
                stop_token_ids=tuple(s.stop_token_ids),
                n=s.n or 1,
            )
            # context.is_active() turns False once the client cancels or its deadline passes
            results, version = self.generate(
                [list(p.token_ids) for p in request.prompts], sampling, context.peer(), is_active=context.is_active
            )
        except (ValueError, SyncError) as exc:
            _abort(context, exc)
        out = rollout_pb2.GenerateResponse(version=version)
        for r in results:
            out.samples.add(
                prompt_index=r.prompt_index,
                token_ids=r.token_ids,
                logprobs=r.logprobs if request.return_logprobs else [],
                finish_reason=r.finish_reason,
                prefix_cache_hit=r.prefix_cache_hit,
            )
        return out

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        client: str,
        is_active=None,
        emit: Emit | None = None,
        on_start: Callable[[int, Lend], None] | None = None,
    ):
        """(results, version) of one generation request: gRPC Generate and HTTP /v1/completions share
        the budget, the validation, fair admission per `client`, the engine run and the metrics.

        `is_active()` is asked between decode steps (engines that yield between steps), or every few
        tens of ms while the engine runs the request (SGLang: `stops_on_cancel`); once it says False
        the request stops with CANCELLED and the engine is free for the next one. On an engine that
        `batches_requests` (SGLang) concurrent calls run at once, each on its caller's thread.

        Streaming: `on_start(version, lend)` is called once the engine admitted the request (version
        pinned, not STALE), before its first step, with the version every token will come from and
        the request's engine_gate.Lend: `emit`, when it must wait (a stream reader with no room),
        waits through `lend` so that other requests take turns meanwhile. `emit` gets each step's
        tokens where the engine `streams_tokens`, else nothing (the caller sends the results at the
        end); the samples it returns as finished (a stop string) are decoded no further (base.Emit)."""
        active = is_active if is_active is not None else (lambda: True)

        def run(eng, turn):
            takes_turns = eng.yields_between_steps
            if on_start is not None:
                # under serve_turns' pin no sync can change the version until this request ends
                on_start(self.tx.version, turn.lend if takes_turns else no_lend)
            kw = {"emit": emit} if emit is not None and eng.streams_tokens else {}
            if not takes_turns and not eng.stops_on_cancel:
                return eng.generate(prompts, sampling, **kw)

            def step():
                if not active():
                    raise GenerationCancelled(
                        "the client cancelled the request or its deadline passed; generation stopped", "CANCELLED"
                    )
                if takes_turns:
                    turn()  # other pinned requests may take a turn here (engine_gate.py)

            return eng.generate(prompts, sampling, step=step, **kw)

        try:
            if not prompts:
                raise ValueError("prompts: need at least 1 prompt, got 0")
            # The budget before anything else: a 60-byte request must not buy hours of engine time.
            check_generate(self.limits, len(prompts), sampling.n, sampling.max_new_tokens)
            sampling.validate()
            with self.admission.admit(client):
                results, version = self.tx.serve_turns(run, _SERVE_WAIT_S, active)
        except SyncError as exc:
            if exc.code != "CANCELLED":  # GenerationCancelled, or the gate's while queued for a turn
                if isinstance(exc, RequestRefused):
                    self._refused(exc)
                self.rollout_metrics.request("error")
                raise
            self.rollout_metrics.request("cancelled")
            raise
        except ValueError:
            self.rollout_metrics.request("error")
            raise
        self.rollout_metrics.request("ok")
        for r in results:
            self.rollout_metrics.prefix_hits.inc(1 if r.prefix_cache_hit else 0)
        return results, version

    def Score(self, request, context):
        try:
            ids = list(request.token_ids)
            if not ids or not 0 < request.prompt_length <= len(ids):
                raise ValueError(f"prompt_length={request.prompt_length} must be in [1, len(token_ids)={len(ids)}]")
            if len(ids) > self.limits.max_request_tokens:
                raise RequestRefused(
                    f"token_ids: {len(ids)} tokens exceed this rollout's limit "
                    f"max_request_tokens={self.limits.max_request_tokens}",
                    "INVALID_ARGUMENT",
                )
            with self.admission.admit(context.peer()):
                (logprobs, logits), version = self.tx.serve(
                    lambda eng: eng.score(ids, request.prompt_length), timeout=_SERVE_WAIT_S
                )
        except RequestRefused as exc:
            self._refused(exc)
            _abort(context, exc)
        except (ValueError, SyncError) as exc:
            _abort(context, exc)
        resp = rollout_pb2.ScoreResponse(logprobs=logprobs, version=version)
        if request.return_last_logits:
            resp.last_logits_f32 = logits.detach().float().contiguous().numpy().astype("<f4").tobytes()
        return resp

    # ---- sync ---------------------------------------------------------------------------
    def PrepareSync(self, request, context):
        try:
            t = request.timeout_seconds
            if not (math.isfinite(t) and 0 <= t <= _MAX_SYNC_TIMEOUT_S):
                # inf / huge values used to crash the abort timer's thread (OverflowError), leaving a
                # prepared sync that never expires
                raise ValueError(
                    f"timeout_seconds={t} must be finite and in [0, {_MAX_SYNC_TIMEOUT_S:.0f}] "
                    "(0 = the rollout's sync_timeout_s)"
                )
            # Identity and sizes before the manifest is parsed: neither touches a tensor entry.
            self.pin.check(request.trainer_id, "PrepareSync")
            self.manifest_limits.check(request.manifest)
            rollback = self.pin.check_rollback(
                request.trainer_id, request.manifest.version, self.tx.version, request.allow_rollback
            )
            manifest = self.layouts.manifest_of(request.manifest)
            if manifest is None:  # named by a digest not held here: nothing prepared, ask for the full one
                return rollout_pb2.PrepareSyncResponse(
                    manifest_needed=True, num_ranks=self.engine.num_ranks(), manifest_runs=self.manifest_runs
                )
            timeout = t if t > 0 else self.sync_timeout
            kind = request.transport.WhichOneof("kind")
            end = self.ends.get(kind)
            if end is None:
                raise SyncError(f"transport is unset: PrepareSync must say {choices()}", "INVALID_ARGUMENT")
            if len(manifest.senders) > 1 and not TRANSPORTS[kind].multi_sender:
                # the other senders' buckets would never come
                raise SyncError(
                    f"manifest.buckets name senders {manifest.senders}; transport {kind} carries the "
                    f"buckets of one sender (multi-sender streaming is {choices(multi_sender_names())})",
                    "INVALID_ARGUMENT",
                )
            resp = rollout_pb2.PrepareSyncResponse(
                num_ranks=self.engine.num_ranks(),
                sync_link=self.sync_link,
                commit_on_stream=TRANSPORTS[kind].commit_on_stream,
                manifest_runs=self.manifest_runs,
            )
            end.prepare(request.transport, manifest, resp)
            deadline = time.monotonic() + timeout
            served = (self.tx.version, self.tx.origin, self.tx.state == rollout_pb2.STALE)
            self.tx.prepare(manifest, timeout)
            self.layouts.remember(manifest)  # the engine accepted it
            offer = request.delta_base if request.HasField("delta_base") else None
            refusal = self.tx.delta_base.prepared(manifest, offer, *served)
            resp.delta_accepted = not refusal
            if offer is not None:
                resp.delta_refusal = refusal
        except (ValueError, SyncError) as exc:
            self.metrics.failure("prepare_rejected")
            _abort(context, exc)
        self._sync_started[manifest.sync_id] = time.perf_counter()
        self._sync_origin = {manifest.sync_id: (request.trainer_id, rollback)}  # only the pending sync can commit
        for other in self.ends.values():
            if other is not end:  # this transport takes over from any receive still waiting on another
                other.supersede(f"superseded by sync {manifest.sync_id} over {kind}")
        try:
            end.receive(manifest, request.transport, deadline, resp)
        except (ValueError, SyncError) as exc:  # e.g. generation could not be paused for a trainer's writes
            self.metrics.failure("prepare_rejected")
            self.tx.abort(manifest.sync_id, f"prepare: {exc}")
            _abort(context, exc)
        _after_answer(
            context,
            lambda: log.info(
                "prepared sync %s: version %d, %d buckets, %d bytes, mode %s",
                manifest.sync_id,
                manifest.version,
                len(manifest.buckets),
                manifest.total_bytes,
                self.tx.apply_mode,
            ),
        )
        return resp

    def PushBucket(self, request, context):
        try:
            self.ipc.push(request)
        except (ValueError, SyncError) as exc:
            self.tx.abort(request.sync_id, f"push failed: {exc}")
            _abort(context, exc)
        return rollout_pb2.PushBucketResponse(index=request.index)

    def IpcBuckets(self, request_iterator, context):
        first: list[str] = []  # the stream's sync, to abort it on a bad bucket
        commit: list[rollout_pb2.CommitSyncRequest] = []  # its last message, when the trainer commits here

        def requests():
            for req in request_iterator:
                if req.HasField("commit"):
                    commit.append(req.commit)
                    return  # nothing may follow the commit
                if not first:
                    first.append(req.sync_id)
                yield req

        try:
            yield from self.ipc.stream(requests())
        except (ValueError, SyncError) as exc:
            if first:
                self.tx.abort(first[0], f"IPC bucket failed: {exc}")
            _abort(context, exc)
        if commit:
            try:
                if first and commit[0].sync_id != first[0]:
                    self.tx.abort(first[0], f"the IpcBuckets stream carried a commit of sync {commit[0].sync_id}")
                    raise SyncError(
                        f"commit of sync {commit[0].sync_id!r} on the IpcBuckets stream of sync {first[0]!r}",
                        "INVALID_ARGUMENT",
                    )
                yield rollout_pb2.PushBucketResponse(commit=self.commit_from_stream(commit[0]))
            except SyncError as exc:
                _abort(context, exc)

    def CommitSync(self, request, context):
        try:
            return self._commit(request, context)
        except SyncError as exc:
            _abort(context, exc)

    def commit_from_stream(self, request: rollout_pb2.CommitSyncRequest) -> rollout_pb2.CommitSyncResponse:
        """The commit carried as the last message of an IpcBuckets stream (an attribute of its own, so
        that tracing wraps it as it wraps CommitSync: weightsync/obs/tracing.py)."""
        return self._commit(request)

    def _commit(self, request: rollout_pb2.CommitSyncRequest, context=None) -> rollout_pb2.CommitSyncResponse:
        """Commit the prepared sync (CommitSync, or the last message of an IpcBuckets stream);
        SyncError when refused."""
        manifest = self.tx.pending_manifest(request.sync_id)
        try:
            prepared_by, rollback = self._sync_origin.get(request.sync_id, (request.trainer_id, False))
            if request.trainer_id != prepared_by:
                raise SyncError(
                    f"CommitSync of sync {request.sync_id} from trainer {request.trainer_id!r}, but "
                    f"trainer {prepared_by!r} prepared it; only the preparing trainer may commit",
                    "FAILED_PRECONDITION",
                )
            version, checksum, _ = self.tx.commit(
                request.sync_id, request.version, {c.index: c.checksum for c in request.checksums}
            )
        except SyncError:
            self.metrics.failure("commit_failed")
            self.metrics.outcome("failed")
            raise
        started = self._sync_started.pop(request.sync_id, None)
        if started is not None:
            self.metrics.sync_duration.labels(self.metrics.role, "").observe(time.perf_counter() - started)
        if manifest is not None:
            self.metrics.sync_bytes.inc(manifest.total_bytes)
        self.metrics.outcome("committed")
        self.pin.committed(prepared_by)
        self.current = True
        if rollback:
            self.metrics.rollbacks.inc()
            log.warning("ROLLBACK committed: now serving version %d from trainer %s", version, prepared_by)
        apply_s = self.tx.last_apply_seconds
        self.rollout_metrics.apply_seconds.observe(apply_s)
        _after_answer(
            context,
            lambda: log.info(
                "committed sync %s: now serving version %d (%.3fs apply)", request.sync_id, version, apply_s
            ),
        )
        return rollout_pb2.CommitSyncResponse(
            version=version,
            weights_checksum=checksum,
            apply_seconds=self.tx.last_apply_seconds,
            bytes_per_rank=self.engine.bytes_per_rank(manifest.total_bytes if manifest is not None else 0),
        )

    def AbortSync(self, request, context):
        prepared_by, _ = self._sync_origin.get(request.sync_id, (request.trainer_id, False))
        if request.trainer_id != prepared_by:
            # the token alone must not let a second trainer (or a replayed call) cancel this one's sync
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"AbortSync of sync {request.sync_id} from trainer {request.trainer_id or '(no id)'!r}, but "
                f"trainer {prepared_by!r} prepared it; only the preparing trainer may abort it",
            )
        had = self.tx.pending_sync_id == request.sync_id
        self.tx.abort(request.sync_id, request.reason or "aborted by trainer")
        self.nccl.abort(request.sync_id, request.reason or "aborted by trainer")
        if had:
            self.metrics.outcome("aborted")
        why_id, why = self.tx.aborted_here
        return rollout_pb2.AbortSyncResponse(
            state=self.tx.state, version=self.tx.version, aborted_reason=why if why_id == request.sync_id else ""
        )

    def ReleaseMemory(self, request, context):
        """Colocated RL: free the engine's GPU memory for the trainer's step (rollout_svc/sync/memory_release.py);
        generation is refused until the next sync commits."""
        t0 = time.perf_counter()
        try:
            t = request.timeout_seconds
            if not (math.isfinite(t) and 0 <= t <= _MAX_RELEASE_WAIT_S):
                raise ValueError(
                    f"timeout_seconds={t} must be finite and in [0, {_MAX_RELEASE_WAIT_S:.0f}] "
                    f"(0 = {_SERVE_WAIT_S:.0f} s): how long to wait for running requests"
                )
            tags = self.tx.release_memory(t or _SERVE_WAIT_S)
        except (ValueError, SyncError) as exc:
            self.rollout_metrics.memory_release("refused")
            _abort(context, exc)
        seconds = time.perf_counter() - t0
        self.rollout_metrics.memory_release("ok")
        log.info("rollout %s: GPU memory released (%s) in %.3f s", self.rollout_id, ", ".join(tags), seconds)
        return rollout_pb2.ReleaseMemoryResponse(
            state=self.tx.state, version=self.tx.version, seconds=seconds, released=list(tags)
        )
