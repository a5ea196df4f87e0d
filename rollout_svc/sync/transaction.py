"""A weight sync on the rollout side, as a transaction: prepare → receive buckets → commit | abort.

Invariant: generation is only ever served from a complete, known version. Weight application
holds the engine gate (rollout_svc/sync/engine_gate.py) exclusively, like a lock; a request holds a
version pin on it for its whole run (requests interleave between decode steps, a sync waits for
the pins), and the version a response reports is read under its pin.

Two apply modes (config `apply_mode`):
- staged  — received tensors are held until commit, then loaded under the lock in one go. The
            engine keeps serving the old version while bytes stream; an abort just drops the
            staging copy. Costs a host copy of the weights.
- inplace — the lock is taken at the first bucket and buckets are loaded as they arrive
            (generation paused, no extra memory). An abort after the first bucket leaves the
            engine STALE: generation is refused until a complete sync commits.
A prepared sync that neither commits nor aborts within its timeout is aborted by a timer.

A sync may have several senders (trainer ranks each streaming the buckets of the tensors they
own; `BucketSpec.sender`). Each sender's buckets arrive in their own order on their own
connection, concurrently with the others; the sync is complete only when every bucket of every
sender has arrived and verified, and a failure on any sender's connection aborts the whole sync.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollout_svc.sync.alarm import Alarm
from rollout_svc.sync.engine_gate import EngineGate
from rollout_svc.quantized import plan_apply
from weightsync.bus.channel import BucketReceiver
from weightsync.bus.checksum import bucket_checksum, combine
from weightsync.bus.errors import SyncError
from weightsync.bus.pack import unpack_bucket
from weightsync.bus.plan import Manifest
from weightsync.bus.verified_copy import PendingChecksum, copy_bucket, copy_into, pending_values
from weightsync.v1 import rollout_pb2

log = logging.getLogger(__name__)
S = rollout_pb2


def _optional(engine, name: str):
    """An optional engine capability (see rollout_svc/engine/base.py), or a no-op."""
    return getattr(engine, name, None) or (lambda *a, **k: None)


def _verify(index: int, ours: int | None, sender_checksum: int | None) -> None:
    if sender_checksum is not None and ours is not None and ours != sender_checksum:
        raise SyncError(f"bucket {index}: checksum {ours:#x} != sender's {sender_checksum:#x} (corrupted in transit)",
                        "DATA_LOSS")


_TIMED_OUT = "timed out before commit"  # the reason the sync's own timer gives


@dataclass
class _Pending:
    manifest: Manifest
    deadline: float
    #: bucket index -> our checksum (a PendingChecksum until commit reads it, for deferred checks)
    received: dict[int, object] = field(default_factory=dict)
    staging: dict[str, torch.Tensor] = field(default_factory=dict)
    applied_any: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    dequantizer: object = None  # weightsync.formats.fp8_import.Dequantizer for quantized syncs, else None
    #: bucket index -> (our checksum still on the GPU, the sender's), until commit reads it
    deferred: dict[int, tuple] = field(default_factory=dict)
    # per sender: its buckets in sending order, and how many of them arrived
    order: dict[int, list[int]] = field(default_factory=dict)
    arrived: dict[int, int] = field(default_factory=dict)
    connected: set[int] = field(default_factory=set)  # senders that opened their stream
    lock: threading.Lock = field(default_factory=threading.Lock)  # bookkeeping of concurrent senders
    committing: bool = False  # a commit passed its checks (it may still wait for the engine)

    def __post_init__(self) -> None:
        for b in self.manifest.buckets:
            self.order.setdefault(b.sender, []).append(b.index)
        self.arrived = dict.fromkeys(self.order, 0)

    def admit(self, index: int) -> None:
        """Bucket `index` is the next one its sender owes; raise otherwise."""
        sender = self.manifest.buckets[index].sender if 0 <= index < len(self.manifest.buckets) else None
        if sender is None:
            raise SyncError(f"bucket {index} arrived; the manifest has {len(self.manifest.buckets)} buckets",
                            "INVALID_ARGUMENT")
        with self.lock:
            k = self.arrived[sender]
            order = self.order[sender]
            if k >= len(order) or order[k] != index:
                want = order[k] if k < len(order) else "none (all arrived)"
                raise SyncError(f"bucket {index} arrived from sender {sender}, expected bucket {want}",
                                "INVALID_ARGUMENT")
            self.arrived[sender] = k + 1

    def record(self, index: int, checksum: int | None) -> None:
        with self.lock:
            self.received[index] = checksum
            if len(self.received) == len(self.manifest.buckets):
                self.done.set()

    def defer(self, index: int, pending: PendingChecksum, sender_checksum: int | None) -> None:
        with self.lock:
            self.deferred[index] = (pending, sender_checksum)

    def resolve(self) -> None:
        """Read every checksum whose copy was left queued (consume_bucket's defer_check) and check
        it against the sender's; SyncError DATA_LOSS on the first mismatch."""
        with self.lock:
            deferred = sorted(self.deferred.items())
        ours = pending_values([pending for _, (pending, _) in deferred])  # one device read for all
        with self.lock:
            for (index, _), value in zip(deferred, ours):
                self.received[index] = value
                del self.deferred[index]
        for (index, (_, sender_checksum)), value in zip(deferred, ours):
            _verify(index, value, sender_checksum)

    def wait_copies(self) -> None:
        """Until no queued copy reads a sender's buffer any more (before an abort lets go of it);
        from the moment a copy is deferred, even before its bucket is recorded."""
        with self.lock:
            pending = [p for p, _ in self.deferred.values()]
        for p in pending:
            p.wait()

    def checksums(self) -> list[int | None]:
        return [self.received[i] for i in range(len(self.manifest.buckets))]

    def loadable(self, named):
        return self.dequantizer(named) if self.dequantizer is not None else named

    def check_complete(self) -> None:
        if self.dequantizer is not None:
            self.dequantizer.check_complete()


class SyncTransaction:
    def __init__(self, engine, apply_mode: str = "staged", on_change: Callable[[], None] | None = None):
        if apply_mode not in ("staged", "inplace"):
            raise ValueError(f"apply_mode={apply_mode!r} must be staged or inplace")
        self.engine = engine
        self.apply_mode = apply_mode
        # A sync acquires it like a lock; requests pin the version and take turns (engine_gate.py).
        self.engine_lock = EngineGate()
        self._state_lock = threading.RLock()
        self._pending: _Pending | None = None
        self._timeout = Alarm("sync-timeout")  # the prepared sync's deadline
        self._metas = engine.param_metas()
        #: layout digests of unquantized manifests already checked against the engine, whose
        #: parameters do not change shape: a steady-state prepare skips walking every tensor again
        self._valid_layouts: set[str] = set()
        self.state = S.SERVING
        self.version = 0
        self.origin = ""
        self.weights_checksum = 0
        self.last_error = ""
        self.last_apply_seconds = 0.0
        self._on_change = on_change or (lambda: None)
        self._lock_held_by_sync = False
        self._pausing = threading.Lock()  # one inplace sender thread waits to pause generation at a time

    # ---- status -------------------------------------------------------------------------
    @property
    def pending_sync_id(self) -> str:
        p = self._pending
        return p.manifest.sync_id if p else ""

    def pending_manifest(self, sync_id: str) -> Manifest | None:
        p = self._pending
        return p.manifest if p and p.manifest.sync_id == sync_id else None

    # ---- phase 1: prepare ---------------------------------------------------------------
    def validate(self, manifest: Manifest):
        """Check names and shapes against the engine before a byte is accepted; returns the
        dequantizer a quantized sync loads through (None otherwise)."""
        digest = manifest.layout_digest if manifest.quantization is None else ""
        if digest and digest in self._valid_layouts:
            return None
        try:
            metas, dequantizer = plan_apply(self.engine, manifest)
        except ValueError as exc:
            raise SyncError(str(exc), "INVALID_ARGUMENT") from exc
        seen = set()
        for meta in metas:
            want = self._metas.get(meta.name)
            if want is None:
                raise SyncError(f"tensor {meta.name}: the engine has no such parameter "
                                f"(trainer family {manifest.model_family or '?'}; check both serve the same model)",
                                "INVALID_ARGUMENT")
            if tuple(want.shape) != tuple(meta.shape):
                raise SyncError(f"tensor {meta.name}: trainer sends shape {list(meta.shape)}, engine expects "
                                f"{list(want.shape)} (different model config?)", "INVALID_ARGUMENT")
            if not (meta.dtype.is_floating_point and want.dtype.is_floating_point) and meta.dtype != want.dtype:
                raise SyncError(f"tensor {meta.name}: dtype {meta.dtype} cannot be loaded as {want.dtype}",
                                "INVALID_ARGUMENT")
            seen.add(meta.name)
        missing = sorted(set(self._metas) - seen)
        if missing:
            raise SyncError(f"tensor {missing[0]}: the manifest lacks it ({len(missing)} engine parameters missing); "
                            "a sync must carry the whole model", "INVALID_ARGUMENT")
        if digest:
            if len(self._valid_layouts) >= 16:  # layouts change rarely; keep the set small
                self._valid_layouts.clear()
            self._valid_layouts.add(digest)
        return dequantizer

    def prepare(self, manifest: Manifest, timeout: float) -> None:
        dequantizer = self.validate(manifest)
        with self._state_lock:
            if self._pending is not None:
                # A newer prepare supersedes a dangling one (e.g. the trainer restarted mid-sync).
                self._abort_locked(f"superseded by sync {manifest.sync_id}")
            if self.state == S.APPLYING:
                raise SyncError("engine is applying weights; retry", "UNAVAILABLE")
            self._pending = _Pending(manifest=manifest, deadline=time.monotonic() + timeout, dequantizer=dequantizer)
            if self.state != S.STALE:
                self.state = S.SYNCING
            sync_id = manifest.sync_id
            self._timeout.arm(timeout, lambda: self._expire(sync_id))
        log.info("prepared sync %s: version %d, %d buckets, %d bytes, mode %s", manifest.sync_id, manifest.version,
                 len(manifest.buckets), manifest.total_bytes, self.apply_mode)
        self._on_change()

    def _expire(self, sync_id: str) -> None:
        with self._state_lock:
            if self._pending and self._pending.manifest.sync_id == sync_id:
                log.warning("sync %s not committed within its timeout; aborting", sync_id)
                self._abort_locked(_TIMED_OUT)

    # ---- phase 2: receive ---------------------------------------------------------------
    def _require(self, sync_id: str) -> _Pending:
        p = self._pending
        if p is None or p.manifest.sync_id != sync_id:
            raise SyncError(f"sync {sync_id} is not prepared here (pending: {self.pending_sync_id or 'none'})")
        if p.error:
            raise SyncError(f"sync {sync_id} already failed: {p.error}")
        return p

    def consume_bucket(self, sync_id: str, index: int, buf: torch.Tensor, sender_checksum: int | None,
                       defer_check: bool = False) -> bool:
        """Accept bucket `index` (bytes in `buf`, which the caller may reuse after return, or, with
        `defer_check`, only once the sync has committed or aborted).

        The copy out of `buf` and the checksum are one pass over the bytes where they can be
        (weightsync/bus/verified_copy.py): staged mode copies the bucket whole and checks it before
        anything enters the staging copy; inplace mode writes straight into the engine's parameters
        and checks after, except for a sync's first bucket, which is checked before the engine is
        touched, so that a bad first bucket still leaves the old version serving, as before (then
        copied in the same way, its copy's sum checked once more).
        `defer_check` (the sender keeps `buf` unchanged until the sync ends): the copy is queued and
        its checksum read at commit, so a caller on a GPU need not wait for it; a mismatch then
        aborts the sync at commit, with the same outcome as at receipt (staged: the old version
        keeps serving; inplace: STALE). Returns whether it did defer: only then does the commit
        wait for this bucket's copies, and otherwise the caller must (no checksums, or the engine's
        own loader)."""
        p = self._require(sync_id)
        p.admit(index)
        plan = p.manifest.buckets[index]
        checked = bool(p.manifest.checksum_algo)
        ours = None
        deferred = False  # a copy of this bucket was left queued, its checksum read at commit
        if self.apply_mode == "staged":
            if checked:
                flat, ours = copy_bucket(plan, buf, wait=not defer_check)
                if defer_check:
                    p.defer(index, ours, sender_checksum)
                    deferred = True
                else:
                    _verify(index, ours, sender_checksum)
                staged = dict(unpack_bucket(plan, flat))  # views of this sync's own copy
            else:
                staged = {name: view.clone() for name, view in unpack_bucket(plan, buf)}
            with p.lock:
                p.staging.update(staged)
        else:
            if checked and not p.applied_any:
                ours = bucket_checksum(buf[:plan.nbytes])
                _verify(index, ours, sender_checksum)
            if not self._lock_held_by_sync:
                self._pause_engine_for_inplace(p)
            # Under the state lock: an abort (timer, AbortSync, a superseding prepare) cannot release
            # the engine lock between our check and the load, and a bucket of an aborted sync is never
            # loaded after the abort (or into the next sync's weights).
            with self._state_lock:
                if self._left_behind(p):
                    raise SyncError(f"sync {sync_id} was aborted: {p.error or 'superseded'}")
                p.applied_any = True
                direct = self._direct_params(plan, p) if checked else None
                if direct is not None:
                    # Already in the parameters when the check runs: a mismatch aborts the sync, and
                    # since buckets were applied the engine is STALE until a complete sync commits.
                    # (The first bucket, checked above, takes the same one-launch copy rather than
                    # the engine's per-tensor loader; its copy's sum is checked once more.)
                    copied = copy_into(plan, buf, direct, wait=not defer_check)
                    if copied is None:  # declined (a parameter not laid out for it): the engine loads
                        direct = None
                    elif defer_check:
                        p.defer(index, copied, sender_checksum)
                        deferred = True
                    else:
                        _verify(index, copied, sender_checksum)
                    if ours is None:
                        ours = copied
                if checked and ours is None:
                    ours = bucket_checksum(buf[:plan.nbytes])
                if not isinstance(ours, PendingChecksum):
                    _verify(index, ours, sender_checksum)
                if direct is None:
                    # Engines that take whole buckets (SGLang's flattened-bucket path) skip the unpack.
                    load_bucket = getattr(self.engine, "load_bucket", None)
                    if load_bucket is not None and p.dequantizer is None:
                        load_bucket(plan, buf)
                    else:
                        self.engine.load_weights(p.loadable(unpack_bucket(plan, buf)))
        p.record(index, ours)
        return deferred

    def _direct_params(self, plan, p: _Pending) -> list[torch.Tensor] | None:
        """The engine's parameters that bucket `plan` can be written into byte for byte, or None."""
        writable = getattr(self.engine, "writable_params", None)
        if writable is None or p.dequantizer is not None or getattr(self.engine, "load_bucket", None) is not None:
            return None
        return writable([slot.meta for slot in plan.slots])

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
                raise SyncError(f"sender {sender} streams no bucket of sync {sync_id} (senders: "
                                f"{sorted(p.order)})", "INVALID_ARGUMENT")
            for plan in p.manifest.buckets_of(sender):
                left = p.deadline - time.monotonic()
                if left <= 0:
                    raise SyncError(f"sync {sync_id}: deadline passed while receiving", "DEADLINE_EXCEEDED")
                buf, csum = receiver.recv(plan, timeout=left)
                self.consume_bucket(sync_id, plan.index, buf, csum)
        except Exception as exc:
            log.error("sync %s: receiving failed: %s", sync_id, exc)
            with self._state_lock:
                if self._pending and self._pending.manifest.sync_id == sync_id:
                    self._pending.error = str(exc)
                    self._pending.done.set()
                    self._abort_locked(f"receive failed: {exc}")
        finally:
            receiver.close()

    # ---- phase 3: commit / abort --------------------------------------------------------
    def commit(self, sync_id: str, version: int, checksums: dict[int, int]) -> tuple[int, int, float]:
        p = self._require(sync_id)
        finished = p.done.wait(timeout=max(0.0, p.deadline - time.monotonic()))
        if not finished or p.error:
            # the deadline passed, or the sync was aborted meanwhile (a stream failed, or the timer
            # fired at the same deadline): name the senders that still owed buckets
            with self._state_lock:
                self._abort_locked("commit arrived before all buckets did")
            missing = {s: len(o) - p.arrived[s] for s, o in p.order.items() if p.arrived[s] < len(o)}
            late = not finished or p.error == _TIMED_OUT
            raise SyncError(f"sync {sync_id}: only {len(p.received)}/{len(p.manifest.buckets)} buckets arrived "
                            f"{'before the deadline' if late else 'before it was aborted: ' + p.error} "
                            f"(missing per sender rank: {missing})", "DEADLINE_EXCEEDED" if late else "FAILED_PRECONDITION")
        with self._state_lock:
            p = self._require(sync_id)
            if p.committing:
                raise SyncError(f"sync {sync_id} is already being committed", "FAILED_PRECONDITION")
            if version != p.manifest.version:
                self._abort_locked("commit version differs from the manifest")
                raise SyncError(f"commit version {version} != prepared version {p.manifest.version}", "INVALID_ARGUMENT")
            try:
                p.resolve()
            except SyncError as exc:
                self._abort_locked(f"at commit: {exc}")
                raise
            if p.manifest.checksum_algo:
                for i, ours in enumerate(p.checksums()):
                    if i in checksums and ours != checksums[i]:
                        self._abort_locked(f"bucket {i} checksum mismatch at commit")
                        raise SyncError(f"bucket {i}: checksum {ours:#x} != trainer's {checksums[i]:#x}", "DATA_LOSS")
                if len(checksums) != len(p.received):
                    self._abort_locked("commit lacks bucket checksums")
                    raise SyncError(f"commit carries {len(checksums)} checksums for {len(p.received)} buckets",
                                    "INVALID_ARGUMENT")
            p.committing = True
        if self.apply_mode == "staged":
            self._acquire_engine_for_commit(p)
        with self._state_lock:
            if self._left_behind(p):  # aborted while the engine was awaited
                if self.apply_mode == "staged":
                    self.engine_lock.release()
                raise SyncError(f"sync {sync_id} was aborted before it could commit: {p.error or 'superseded'}")
            t0 = time.perf_counter()
            try:
                if self.apply_mode == "staged":
                    try:
                        self.state = S.APPLYING
                        self.engine.load_weights(p.loadable(p.staging.items()))
                        p.check_complete()
                        self.engine.flush_cache()
                        self._finish_locked(p, version)
                    finally:
                        self.engine_lock.release()
                else:
                    p.check_complete()
                    end_apply = getattr(self.engine, "end_apply", None)  # flushes and resumes (SGLang)
                    (end_apply or self.engine.flush_cache)()
                    self._finish_locked(p, version)
                    self._release_sync_lock()
            except Exception as exc:
                self.state = S.STALE
                self.last_error = f"apply failed at commit: {exc}"
                self._release_sync_lock()
                self._clear_pending()
                raise SyncError(self.last_error, "INTERNAL") from exc
            self.last_apply_seconds = time.perf_counter() - t0 + 0.0
            log.info("committed sync %s: now serving version %d (%.3fs apply)", sync_id, version, self.last_apply_seconds)
        self._on_change()
        return self.version, self.weights_checksum, time.monotonic() - p.started

    def _left_behind(self, p: _Pending) -> bool:
        """`p` is no longer the sync in progress: aborted, or superseded by a newer prepare."""
        return self._pending is not p or bool(p.error)

    def _pause_engine_for_inplace(self, p: _Pending) -> None:
        """Inplace: take the engine for the rest of the sync before its first bucket is loaded.

        The wait for running generations happens outside the state lock, so an abort or a newer
        prepare is answered at once and ends it (nothing was loaded yet: the old version serves);
        with several senders, one thread waits and the others wait for it."""
        gone = functools.partial(self._left_behind, p)
        if not self._pausing.acquire(timeout=max(0.0, p.deadline - time.monotonic())):
            raise SyncError("could not pause generation before the sync deadline", "DEADLINE_EXCEEDED")
        try:
            if self._lock_held_by_sync:
                return  # another sender's thread paused it meanwhile
            got = self.engine_lock.acquire(timeout=max(0.0, p.deadline - time.monotonic()), give_up=gone)
            with self._state_lock:
                if got and gone():
                    self.engine_lock.release()
                if gone() and p.error != _TIMED_OUT:
                    raise SyncError(f"sync {p.manifest.sync_id} was aborted while it waited to pause generation: "
                                    f"{p.error or 'superseded'}")
                if not got or gone():  # the deadline passed (our wait's or the sync's timer)
                    raise SyncError("could not pause generation before the sync deadline", "DEADLINE_EXCEEDED")
                self._lock_held_by_sync = True
                self.state = S.APPLYING
                _optional(self.engine, "begin_apply")()
        finally:
            self._pausing.release()

    def _acquire_engine_for_commit(self, p: _Pending) -> None:
        """Staged commit: wait until no generation pins the engine, no longer than the sync may last.

        Outside the state lock, so that an abort (the trainer's, SIGTERM's, the timer's) or a newer
        prepare is taken at once rather than after the wait, and ends the wait; the staged weights
        were never applied, so the old version keeps serving either way."""
        gone = functools.partial(self._left_behind, p)
        if self.engine_lock.acquire(timeout=max(0.0, p.deadline - time.monotonic()), give_up=gone):
            return
        with self._state_lock:
            if not gone():
                self._abort_locked("the engine stayed busy generating until the sync's deadline")
            elif p.error != _TIMED_OUT:  # the timer at the same deadline is the same verdict as ours
                raise SyncError(f"sync {p.manifest.sync_id} was aborted while its commit waited for the engine: "
                                f"{p.error or 'superseded'}")
        raise SyncError(f"sync {p.manifest.sync_id}: the engine did not become free to apply the weights "
                        "before the sync's deadline (a long generation holds it); raise the sync "
                        "timeout or lower the rollout's generation limits", "DEADLINE_EXCEEDED")

    def _finish_locked(self, p: _Pending, version: int) -> None:
        self.version = version
        self.origin = p.manifest.origin
        self.weights_checksum = combine([c or 0 for c in p.checksums()])
        self.state = S.SERVING
        self.last_error = ""
        self._clear_pending()

    def abort(self, sync_id: str, reason: str) -> None:
        with self._state_lock:
            if self._pending is None or (sync_id and self._pending.manifest.sync_id != sync_id):
                return  # idempotent: nothing (or something else) is pending
            self._abort_locked(reason)
        self._on_change()

    def _abort_locked(self, reason: str) -> None:
        p = self._pending
        if p is None:
            return
        p.wait_copies()  # a copy still queued reads the sender's buffer, which it may now reuse
        p.error = p.error or reason
        p.done.set()
        if p.applied_any or self.state == S.STALE:
            self.state = S.STALE
            self.last_error = f"sync {p.manifest.sync_id} aborted after weights were partly applied ({reason}); " \
                              "generation refused until a complete sync commits"
        else:
            self.state = S.SERVING
            self.last_error = f"sync {p.manifest.sync_id} aborted ({reason}); still serving version {self.version}"
        log.warning(self.last_error)
        self._release_sync_lock()
        self._clear_pending()

    def _clear_pending(self) -> None:
        self._timeout.cancel()
        self._pending = None

    def _release_sync_lock(self) -> None:
        if self._lock_held_by_sync:
            self._lock_held_by_sync = False
            self.engine_lock.release()

    # ---- serving ------------------------------------------------------------------------
    def serve(self, fn, timeout: float):
        """Run `fn(engine)` pinned to the served version; returns (result, version it was served from)."""
        return self.serve_turns(lambda engine, turn: fn(engine), timeout)

    def serve_turns(self, fn, timeout: float, is_active: Callable[[], bool] = lambda: True):
        """Run `fn(engine, turn)` under a version pin; `fn` calls `turn()` between engine steps to
        let other requests interleave (and to stop once `is_active()` turns false). No sync can
        change the weights while the pin is held, so the version returned is the one every step used."""
        with self.engine_lock.pinned(timeout, is_active) as turn:
            if self.state == S.STALE:
                raise SyncError(f"engine is STALE: {self.last_error}", "UNAVAILABLE")
            turn.check()
            return fn(self.engine, turn), self.version
