"""A weight sync on the rollout side, as a transaction: prepare → receive buckets → commit | abort.

Invariant: generation is only ever served from a complete, known version. Weight application
holds the engine gate (rollout_svc/sync/engine_gate.py) exclusively, like a lock; a request holds a
version pin on it for its whole run (requests interleave between decode steps, a sync waits for
the pins), and the version a response reports is read under its pin.

How buckets reach the engine is the apply strategy that config `apply_mode` selects (apply.py):
staged (held until commit; an abort leaves the old version serving) or inplace (loaded as they
arrive; an abort after the first bucket leaves the engine STALE until a complete sync commits).
A prepared sync that neither commits nor aborts within its timeout is aborted by a timer.

A sync may have several senders (trainer ranks each streaming the buckets of the tensors they
own; `BucketSpec.sender`). Each sender's buckets arrive in their own order on their own
connection, concurrently with the others; the sync is complete only when every bucket of every
sender has arrived and verified, and a failure on any sender's connection aborts the whole sync.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from rollout_svc.engine.base import Engine
from rollout_svc.quantized import plan_apply, write_metas
from rollout_svc.sync import memory_release
from rollout_svc.sync.alarm import Alarm
from rollout_svc.sync.apply import ApplyStrategy
from rollout_svc.sync.apply_inplace import InPlaceApply
from rollout_svc.sync.apply_staged import StagedApply
from rollout_svc.sync.delta_base import DeltaBase
from rollout_svc.sync.engine_gate import EngineGate
from rollout_svc.sync.pending import TIMED_OUT, PendingSync
from weightsync.bus.channel import BucketReceiver
from weightsync.bus.copy.checksum import combine
from weightsync.bus.errors import SyncError
from weightsync.bus.plan import Manifest, bulk
from weightsync.formats.fp8.receive import Dequantizer
from weightsync.v1 import rollout_pb2

log = logging.getLogger(__name__)
S = rollout_pb2


#: apply_mode -> the strategy that moves received buckets into the engine
APPLY_MODES: dict[str, type[ApplyStrategy]] = {"staged": StagedApply, "inplace": InPlaceApply}


class SyncTransaction:
    def __init__(self, engine: Engine, apply_mode: str = "staged", on_change: Callable[[], None] | None = None):
        if apply_mode not in APPLY_MODES:
            raise ValueError(f"apply_mode={apply_mode!r} must be staged or inplace")
        self.engine = engine
        self.apply_mode = apply_mode
        # A sync acquires it like a lock; requests pin the version and take turns, unless the engine
        # batches requests itself (engine_gate.py).
        self.engine_lock = EngineGate()
        self.state_lock = threading.RLock()
        self._pending: PendingSync | None = None
        self._timeout = Alarm("sync-timeout")  # the prepared sync's deadline
        self._metas = engine.param_metas()
        #: (layout digest, quantization) of manifests already checked against the engine, whose
        #: parameters do not change shape, to the dequantizer their syncs load through (None: none):
        #: a steady-state prepare skips walking every tensor again (a block-FP8 layout also pairs every
        #: weight with its scale)
        self._valid_layouts: dict[tuple, Dequantizer | None] = {}
        self.state = S.SERVING
        self.version = 0
        self.origin = ""
        self.weights_checksum = 0
        self.last_error = ""
        #: (sync_id, "CODE: reason") of the last sync this rollout aborted on its own while receiving
        self.aborted_here: tuple[str, str] = ("", "")
        self.last_apply_seconds = 0.0
        #: the engine's GPU memory was released for a colocated train step (release_memory): generation is
        #: refused until a sync commits, whatever that sync's outcome before then (the weights' contents are gone)
        self.memory_released = False
        self._on_change = on_change or (lambda: None)
        self._apply = APPLY_MODES[apply_mode](self)
        #: the committed version's buckets as received over TCP, which delta buckets apply onto
        self.delta_base = DeltaBase()

    # ---- status -------------------------------------------------------------------------
    @property
    def pending_sync_id(self) -> str:
        p = self._pending
        return p.manifest.sync_id if p else ""

    def write_metas(self, manifest: Manifest):
        """What the trainer writes into the engine for a quantized `manifest` when it writes the sync
        itself (quantized.write_metas; None: it cannot)."""
        return write_metas(self.engine, manifest)

    def pending_manifest(self, sync_id: str) -> Manifest | None:
        p = self._pending
        return p.manifest if p and p.manifest.sync_id == sync_id else None

    # ---- phase 1: prepare ---------------------------------------------------------------
    def validate(self, manifest: Manifest):
        """Check names and shapes against the engine before a byte is accepted; returns the
        dequantizer a quantized sync loads through (None otherwise)."""
        key = (manifest.layout_digest, manifest.quantization)
        if manifest.layout_digest and key in self._valid_layouts:
            checked = self._valid_layouts[key]
            return None if checked is None else checked.fresh()  # one per sync: it holds unpaired halves
        try:
            with bulk():  # a layout not checked yet: every tensor, paired (block FP8)
                metas, dequantizer = plan_apply(self.engine, manifest)
        except ValueError as exc:
            raise SyncError(str(exc), "INVALID_ARGUMENT") from exc
        seen = set()
        for meta in metas:
            want = self._metas.get(meta.name)
            if want is None:
                raise SyncError(
                    f"tensor {meta.name}: the engine has no such parameter "
                    f"(trainer family {manifest.model_family or '?'}; check both serve the same model)",
                    "INVALID_ARGUMENT",
                )
            if tuple(want.shape) != tuple(meta.shape):
                raise SyncError(
                    f"tensor {meta.name}: trainer sends shape {list(meta.shape)}, engine expects "
                    f"{list(want.shape)} (different model config?)",
                    "INVALID_ARGUMENT",
                )
            if not (meta.dtype.is_floating_point and want.dtype.is_floating_point) and meta.dtype != want.dtype:
                raise SyncError(
                    f"tensor {meta.name}: dtype {meta.dtype} cannot be loaded as {want.dtype}", "INVALID_ARGUMENT"
                )
            seen.add(meta.name)
        missing = sorted(set(self._metas) - seen)
        if missing:
            raise SyncError(
                f"tensor {missing[0]}: the manifest lacks it ({len(missing)} engine parameters missing); "
                "a sync must carry the whole model",
                "INVALID_ARGUMENT",
            )
        if manifest.layout_digest:
            if len(self._valid_layouts) >= 16:  # layouts change rarely; keep the set small
                self._valid_layouts.clear()
            self._valid_layouts[key] = dequantizer
            return None if dequantizer is None else dequantizer.fresh()
        return dequantizer

    def prepare(self, manifest: Manifest, timeout: float) -> None:
        dequantizer = self.validate(manifest)
        with self.state_lock:
            if self._pending is not None:
                # A newer prepare supersedes a dangling one (e.g. the trainer restarted mid-sync).
                self.abort_locked(f"superseded by sync {manifest.sync_id}")
            if self.state == S.APPLYING:
                raise SyncError("engine is applying weights; retry", "UNAVAILABLE")
            self._pending = PendingSync(manifest=manifest, deadline=time.monotonic() + timeout, dequantizer=dequantizer)
            if self.state != S.STALE:
                self.state = S.SYNCING
            sync_id = manifest.sync_id
            self._timeout.arm(timeout, lambda: self._expire(sync_id))
        self._on_change()

    def _expire(self, sync_id: str) -> None:
        with self.state_lock:
            if self._pending and self._pending.manifest.sync_id == sync_id:
                log.warning("sync %s not committed within its timeout; aborting", sync_id)
                self.abort_locked(TIMED_OUT)

    # ---- phase 2: receive ---------------------------------------------------------------
    def _require(self, sync_id: str) -> PendingSync:
        p = self._pending
        if p is None or p.manifest.sync_id != sync_id:
            gone_id, why = self.aborted_here
            if gone_id == sync_id and gone_id:  # aborted here while receiving: say why, with its code
                code, _, details = why.partition(": ")
                raise SyncError(f"sync {sync_id} was aborted here: {details}", code)
            raise SyncError(f"sync {sync_id} is not prepared here (pending: {self.pending_sync_id or 'none'})")
        if p.error:
            # the receive thread records why (with its code) before it aborts; a commit can land between the two
            gone_id, why = self.aborted_here
            code = why.partition(": ")[0] if gone_id == sync_id else ""
            raise SyncError(f"sync {sync_id} already failed: {p.error}", code or "FAILED_PRECONDITION")
        return p

    def consume_bucket(
        self, sync_id: str, index: int, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool = False
    ) -> bool:
        """Accept bucket `index` (bytes in `buf`, which the caller may reuse after return, or, with
        `defer_check`, only once the sync has committed or aborted).

        The copy out of `buf` and the checksum are one pass over the bytes where they can be
        (weightsync/bus/copy/verified_copy.py); the apply strategy says when the check runs
        (apply_staged.py, apply_inplace.py).
        `defer_check` (the sender keeps `buf` unchanged until the sync ends): the copy is queued and
        its checksum read at commit, so a caller on a GPU need not wait for it; a mismatch then
        aborts the sync at commit, with the same outcome as at receipt (staged: the old version
        keeps serving; inplace: STALE). Returns whether it did defer: only then does the commit
        wait for this bucket's copies, and otherwise the caller must (no checksums, or the engine's
        own loader)."""
        p = self._require(sync_id)
        p.admit(index)
        ours, deferred = self._apply.consume(p, p.manifest.buckets[index], buf, sender_checksum, defer_check)
        p.record(index, ours)
        return deferred

    def accept_trainer_writes(self, sync_id: str) -> None:
        """The trainer will write sync `sync_id`'s buckets straight into the engine (CUDA IPC,
        weightsync/bus/ipc/trainer_writes.py): pause generation now, before the prepare's answer lets
        it write. From here the engine counts as written: an abort leaves it STALE until a complete
        sync commits, as an in-place sync that loaded a bucket. SyncError (the sync aborted) when
        generation could not be paused before the deadline or the apply mode is not inplace."""
        p = self._require(sync_id)
        hold = getattr(self._apply, "hold_for_writes", None)
        try:
            if hold is None:
                raise SyncError(
                    f"apply_mode={self.apply_mode}: the trainer writes into the engine only in inplace mode",
                    "FAILED_PRECONDITION",
                )
            hold(p)
        except SyncError as exc:
            self.abort(sync_id, f"could not hand the engine to the trainer: {exc}")
            raise

    def run_receiver(self, sync_id: str, receiver: BucketReceiver, sender: int = 0) -> None:
        """Pull every bucket `sender` streams in the pending sync from `receiver`; on failure record
        it and abort the whole sync (every sender's part). A second stream claiming a sender that
        already has one is refused without touching the sync."""
        p = self._pending
        if p is not None and p.manifest.sync_id == sync_id:
            with p.lock:
                duplicate = sender in p.connected
                p.connected.add(sender)
            if duplicate:
                log.warning("sync %s: a second stream for sender %d refused", sync_id, sender)
                receiver.close()
                return
        try:
            p = self._require(sync_id)
            if sender not in p.order:
                raise SyncError(
                    f"sender {sender} streams no bucket of sync {sync_id} (senders: {sorted(p.order)})",
                    "INVALID_ARGUMENT",
                )
            for plan in p.manifest.buckets_of(sender):
                left = p.deadline - time.monotonic()
                if left <= 0:
                    raise SyncError(f"sync {sync_id}: deadline passed while receiving", "DEADLINE_EXCEEDED")
                buf, csum = receiver.recv(plan, timeout=left)
                self.consume_bucket(sync_id, plan.index, buf, csum)
        except Exception as exc:
            log.error("sync %s: receiving failed: %s", sync_id, exc)
            with self.state_lock:
                if self._pending and self._pending.manifest.sync_id == sync_id:
                    # the trainer sees only a closed stream: AbortSync answers it this reason
                    self.aborted_here = (sync_id, f"{getattr(exc, 'code', '') or 'UNAVAILABLE'}: {exc}")
                    self._pending.error = str(exc)
                    self._pending.done.set()
                    self.abort_locked(f"receive failed: {exc}")
        finally:
            receiver.close()

    # ---- phase 3: commit / abort --------------------------------------------------------
    def commit(self, sync_id: str, version: int, checksums: dict[int, int]) -> tuple[int, int, float]:
        p = self._require(sync_id)
        if p.trainer_writes:
            # the trainer synchronized its stream before committing: every byte is in the engine,
            # and the sums of what its kernel wrote are the version's checksums
            p.trainer_wrote(checksums)
        self._await_buckets(p)
        with self.state_lock:
            p = self._require(sync_id)
            self._check_commit(p, version, checksums)
            p.committing = True
        self._apply.take_engine_for_commit(p)
        with self.state_lock:
            if self.left_behind(p):  # aborted while the engine was awaited
                self._apply.release()
                raise SyncError(f"sync {sync_id} was aborted before it could commit: {p.error or 'superseded'}")
            t0 = time.perf_counter()
            try:
                self._apply.apply(p)
                self._finish_locked(p, version)
            except Exception as exc:
                self.state = S.STALE
                self.last_error = f"apply failed at commit: {exc}"
                self._clear_pending()
                raise SyncError(self.last_error, "INTERNAL") from exc
            finally:
                self._apply.release()  # after the new version (or STALE) is set: a request pinned next sees it
            self.last_apply_seconds = time.perf_counter() - t0 + 0.0
        self._on_change()
        return self.version, self.weights_checksum, time.monotonic() - p.started

    def _await_buckets(self, p: PendingSync) -> None:
        """Until every bucket of every sender arrived; otherwise abort, naming the senders that still
        owed buckets (the deadline passed, or the sync was aborted meanwhile: a stream failed, or
        the timer fired at the same deadline)."""
        finished = p.done.wait(timeout=max(0.0, p.deadline - time.monotonic()))
        if finished and not p.error:
            return
        with self.state_lock:
            self.abort_locked("commit arrived before all buckets did")
        late = not finished or p.error == TIMED_OUT
        corrupt = self.aborted_here[0] == p.manifest.sync_id and self.aborted_here[1].startswith("DATA_LOSS")
        raise SyncError(
            f"sync {p.manifest.sync_id}: only {len(p.received)}/{len(p.manifest.buckets)} buckets "
            f"arrived {'before the deadline' if late else 'before it was aborted: ' + p.error} "
            f"(missing per sender rank: {p.missing()})",
            "DEADLINE_EXCEEDED" if late else "DATA_LOSS" if corrupt else "FAILED_PRECONDITION",
        )

    def _check_commit(self, p: PendingSync, version: int, checksums: dict[int, int]) -> None:
        """The commit against what was prepared and received (under state_lock); a mismatch aborts."""
        if p.committing:
            raise SyncError(f"sync {p.manifest.sync_id} is already being committed", "FAILED_PRECONDITION")
        if version != p.manifest.version:
            self.abort_locked("commit version differs from the manifest")
            raise SyncError(f"commit version {version} != prepared version {p.manifest.version}", "INVALID_ARGUMENT")
        try:
            p.resolve()
        except SyncError as exc:
            self.abort_locked(f"at commit: {exc}")
            raise
        if not p.manifest.checksum_algo:
            return
        for i, ours in enumerate(p.checksums()):
            if i in checksums and ours != checksums[i]:
                self.abort_locked(f"bucket {i} checksum mismatch at commit")
                raise SyncError(f"bucket {i}: checksum {ours:#x} != trainer's {checksums[i]:#x}", "DATA_LOSS")
        if len(checksums) != len(p.received):
            self.abort_locked("commit lacks bucket checksums")
            raise SyncError(
                f"commit carries {len(checksums)} checksums for {len(p.received)} buckets", "INVALID_ARGUMENT"
            )

    def _finish_locked(self, p: PendingSync, version: int) -> None:
        self.version = version
        self.origin = p.manifest.origin
        self.weights_checksum = combine([c or 0 for c in p.checksums()])
        self.delta_base.committed(p.manifest)
        if self.memory_released:
            # the sync's own apply mapped the weights and the rest (the engine's end_apply); anything it
            # left released is mapped now, before the first request is served
            self.engine.resume_memory()
            self.memory_released = False
        self.state = S.SERVING
        self.last_error = ""
        self._clear_pending()

    # ---- for the apply strategies (apply.SyncHost) and abort ----------------------------
    def left_behind(self, p: PendingSync) -> bool:
        """`p` is no longer the sync in progress: aborted, or superseded by a newer prepare."""
        return self._pending is not p or bool(p.error)

    def abort(self, sync_id: str, reason: str) -> None:
        with self.state_lock:
            if self._pending is None or (sync_id and self._pending.manifest.sync_id != sync_id):
                return  # idempotent: nothing (or something else) is pending
            self.abort_locked(reason)
        self._on_change()

    def abort_locked(self, reason: str) -> None:
        """Abort the pending sync, if any; the caller holds state_lock."""
        p = self._pending
        if p is None:
            return
        p.wait_copies()  # a copy still queued reads the sender's buffer, which it may now reuse
        p.error = p.error or reason
        p.done.set()
        if p.applied_any or self.state == S.STALE:
            self.state = S.STALE
            self.last_error = (
                f"sync {p.manifest.sync_id} aborted after weights were partly applied ({reason}); "
                "generation refused until a complete sync commits"
            )
        else:
            self.state = S.SERVING
            self.last_error = f"sync {p.manifest.sync_id} aborted ({reason}); still serving version {self.version}"
        log.warning(self.last_error)
        self._apply.release()
        self._clear_pending()

    # ---- colocated: the engine's GPU memory handed to the trainer between syncs -----------
    def release_memory(self, timeout: float) -> tuple[str, ...]:
        """Free the engine's GPU memory for a colocated train step (memory_release.py); returns the tags released."""
        return memory_release.release(self, timeout)

    def _clear_pending(self) -> None:
        self._timeout.cancel()
        self._pending = None

    # ---- serving ------------------------------------------------------------------------
    def serve(self, fn, timeout: float):
        """Run `fn(engine)` pinned to the served version; returns (result, version it was served from)."""
        return self.serve_turns(lambda engine, turn: fn(engine), timeout)

    def serve_turns(self, fn, timeout: float, is_active: Callable[[], bool] = lambda: True):
        """Run `fn(engine, turn)` under a version pin; `fn` calls `turn()` between engine steps to
        let other requests interleave (and to stop once `is_active()` turns false). No sync can
        change the weights while the pin is held, so the version returned is the one every step used."""
        # an engine that batches requests itself (SGLang) runs every pinned request at once: no turns
        takes_turns = not self.engine.batches_requests
        with self.engine_lock.pinned(timeout, is_active, takes_turns=takes_turns) as turn:
            if self.state == S.STALE:
                raise SyncError(f"engine is STALE: {self.last_error}", "UNAVAILABLE")
            if self.memory_released:
                raise SyncError(
                    "the engine's GPU memory is released for a colocated train step (ReleaseMemory); "
                    "it serves again once the next sync commits; retry then",
                    "UNAVAILABLE",
                )
            turn.check()
            return fn(self.engine, turn), self.version
