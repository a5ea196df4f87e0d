"""The rollout's copy of its committed version's buckets: the base a delta sync is applied onto.

A delta bucket (weightsync/bus/delta.py) carries only the words that changed since the trainer's
last committed export, so the rollout needs that export's bucket bytes. It keeps its own copy, as
the buckets arrived (host memory: one copy of the model's export bytes), rather than reading the
engine's parameters back: an engine may hold them in another dtype or layout (fused, sharded,
dequantized), and staged and in-place apply then work the same way.

Every sync over TCP writes its buckets into the copy as they arrive (a dense bucket is copied, a
delta applied onto the bucket in place), so the copy is the base only once that sync has committed
(`committed`); from the prepare on it is no one's base, and a sync that aborts leaves no base: the
next one is sent in full. A delta is accepted only for exactly the base this rollout serves — same
trainer origin, version and bucket layout, and the sync it committed is one the trainer names as
a stream of its base's bytes (several syncs may stream one version, to different rollouts; see
weightsync/publisher/delta_sync.py) — and a wrong base or damaged delta still fails the
transaction's checksum of the resulting bucket. Allocated at the first TCP sync only: a rollout
synced over IPC or NCCL keeps nothing.
"""

from __future__ import annotations

import threading

import torch

from weightsync.bus.delta import apply_delta
from weightsync.bus.errors import TransportError
from weightsync.bus.plan import BucketPlan, Manifest


class DeltaBase:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._bufs: dict[int, torch.Tensor] = {}
        self._layout = ""  # the layout digest the buffers are laid out for
        #: (origin, version, layout_digest) of the committed version the copy holds, or None
        self.held: tuple[str, int, str] | None = None
        self.held_sync = ""  # the sync whose stream the copy holds (with `held`)
        self._sync = ""  # the sync writing into the copy
        self._delta_ok = False
        self._written: set[int] = set()

    def prepared(self, manifest: Manifest, offer, version: int, origin: str, stale: bool) -> str:
        """Sync `manifest` was prepared, the rollout serving (`origin`, `version`; `stale`: an aborted
        in-place sync left the engine half-written); `offer` is the trainer's DeltaBase or None.
        From now on the copy is this sync's. Returns "" if its buckets may come as deltas, else why not."""
        with self._lock:
            reason = self._refusal(manifest, offer, version, origin, stale)
            self.held, self.held_sync = None, ""  # whatever this sync writes replaces it
            self._sync = manifest.sync_id if self.enabled else ""
            self._delta_ok = not reason
            self._written = set()
            if manifest.layout_digest != self._layout:
                self._bufs, self._layout = {}, manifest.layout_digest
            return reason

    def _refusal(self, manifest: Manifest, offer, version: int, origin: str, stale: bool) -> str:
        if not self.enabled:
            return "this rollout keeps no delta base (bus.delta_base=false)"
        if offer is None:
            return "no delta base offered"
        want = (offer.origin, offer.version, offer.layout_digest)
        if self.held is None:
            return "no base held (the last sync did not commit here over tcp, or the rollout restarted)"
        if self.held != want:
            return f"holds version {self.held[1]} of {self.held[0] or '?'}, offered {offer.version} of {offer.origin}"
        if self.held_sync not in offer.sync_ids:
            return (
                f"holds the stream of sync {self.held_sync}, not one the trainer's base is (latest: "
                f"{offer.sync_ids[-1] if offer.sync_ids else 'none named'}): the version was streamed again, changed"
            )
        if offer.layout_digest != manifest.layout_digest or not manifest.layout_digest:
            return "the bucket layout changed since the base"
        if stale or (origin, version) != (offer.origin, offer.version):
            return f"serving version {version} of {origin or '?'}{' (stale)' if stale else ''}, not the base"
        return ""

    def for_sync(self, sync_id: str) -> _SyncWriter | None:
        """What a TCP receiver of `sync_id` writes through (weightsync/bus/tcp/wire.py), or None."""
        return _SyncWriter(self, sync_id) if self.enabled and sync_id == self._sync else None

    def _buffer(self, sync_id: str, plan: BucketPlan, create: bool) -> torch.Tensor:
        """The copy of bucket `plan` for `sync_id` to write; the caller holds the lock until it has
        written (a superseded sync's receiver must not write into the next sync's copy)."""
        if sync_id != self._sync:
            raise TransportError(f"sync {sync_id} no longer owns the delta base (superseded)")
        buf = self._bufs.get(plan.index)
        if buf is None or buf.numel() != plan.nbytes:
            if not create:
                raise TransportError(f"bucket {plan.index}: a delta, but no base copy of the bucket is held")
            buf = self._bufs[plan.index] = torch.empty(plan.nbytes, dtype=torch.uint8)
        return buf

    def committed(self, manifest: Manifest) -> None:
        """Sync `manifest` committed: if every bucket of it went through the copy, the copy is its base."""
        with self._lock:
            if manifest.sync_id == self._sync and len(self._written) == len(manifest.buckets):
                self.held = (manifest.origin, manifest.version, manifest.layout_digest)
                self.held_sync = manifest.sync_id
            self._sync = ""

    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())


class _SyncWriter:
    """One sync's writes into the copy (see TcpBucketReceiver's `base`)."""

    def __init__(self, base: DeltaBase, sync_id: str):
        self.base, self.sync_id = base, sync_id

    def received(self, plan: BucketPlan, dense: torch.Tensor) -> torch.Tensor:
        with self.base._lock:
            buf = self.base._buffer(self.sync_id, plan, create=True)
            buf.copy_(dense[: plan.nbytes])
            self.base._written.add(plan.index)
        return buf

    def patched(self, plan: BucketPlan, payload: torch.Tensor) -> torch.Tensor:
        with self.base._lock:
            buf = self.base._buffer(self.sync_id, plan, create=False)
            if not self.base._delta_ok:
                raise TransportError(f"bucket {plan.index}: a delta frame, but this rollout refused the delta base")
            apply_delta(payload, buf)
            self.base._written.add(plan.index)
        return buf
