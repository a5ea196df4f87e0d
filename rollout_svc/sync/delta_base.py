"""The rollout's copy of its committed version's buckets: the base a delta sync is applied onto.

A delta bucket (weightsync/bus/delta/codec.py) carries only the words that changed since the trainer's
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
transaction's checksum of the resulting bucket. Allocated at the first TCP sync, or the first NCCL
sync whose trainer offered a base (its buckets then come framed: weightsync/bus/nccl/framed.py;
the copy is then on the rollout's GPU, one more copy of the export bytes there); a rollout synced
over IPC, or over NCCL without an offer, keeps nothing.

The copy keeps each bucket's word sums (checksum.word_sums, of its whole 32-bit words), taken from
the apply strategy's checked copy out of the bucket (copy/verified_copy.py's `sums_to`: the checksum pass
every sync makes, so a full sync pays no extra pass for them; `sums_keeper`) and carried through a
delta from the words it overwrote
(delta.apply_delta), always under the lock that guards the bytes: a delta bucket's checksum is
then `from_sums` of those, not a pass over the bucket — the same value, so a wrong base or a
damaged delta fails as before. A delta bucket's written positions (`patch`) let an apply strategy
write only those words into an engine that holds exactly the copy's bytes: `engine_matches` says
it does, set only when a sync committed with every bucket written into the engine byte for byte
(`engine_wrote`), and cleared at every prepare.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from weightsync.bus.copy.checksum import from_sums
from weightsync.bus.delta.codec import Applied, apply_delta
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
        #: bucket index -> word sums of the copy's bucket; dropped whenever its bytes change otherwise
        self._sums: dict[int, torch.Tensor] = {}
        #: this sync's delta buckets: index -> what the delta wrote (read once by the apply strategy)
        self._patches: dict[int, Applied] = {}
        #: the engine's parameters were exactly the copy's bytes when this sync was prepared
        self._engine_was_base = False
        self._engine_exact: set[int] = set()  # buckets this sync wrote into the engine byte for byte
        self._engine_ptrs: set[int] = set()  # the parameters they went to (addresses)
        self._engine_aliased = False  # two tensors of this sync went to one parameter
        #: the engine's parameters are exactly the held copy's bytes (see engine_wrote)
        self.engine_matches = False

    def prepared(self, manifest: Manifest, offer, version: int, origin: str, stale: bool) -> str:
        """Sync `manifest` was prepared, the rollout serving (`origin`, `version`; `stale`: an aborted
        in-place sync left the engine half-written); `offer` is the trainer's DeltaBase or None.
        From now on the copy is this sync's. Returns "" if its buckets may come as deltas, else why not."""
        with self._lock:
            reason = self._refusal(manifest, offer, version, origin, stale)
            self._engine_was_base = self.engine_matches and not reason
            self.held, self.held_sync, self.engine_matches = None, "", False  # whatever this sync writes replaces it
            self._sync = manifest.sync_id if self.enabled else ""
            self._delta_ok = not reason
            self._written, self._patches, self._engine_exact = set(), {}, set()
            self._engine_ptrs, self._engine_aliased = set(), False
            if manifest.layout_digest != self._layout:
                self._bufs, self._sums, self._layout = {}, {}, manifest.layout_digest
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

    def _buffer(self, sync_id: str, plan: BucketPlan, create: bool, device: torch.device) -> torch.Tensor:
        """The copy of bucket `plan` for `sync_id` to write, on `device` (where the bus delivers:
        host memory for tcp, the rollout's GPU for nccl); the caller holds the lock until it has
        written (a superseded sync's receiver must not write into the next sync's copy)."""
        if sync_id != self._sync:
            raise TransportError(f"sync {sync_id} no longer owns the delta base (superseded)")
        buf = self._bufs.get(plan.index)
        if buf is None or buf.numel() != plan.nbytes or buf.device != device:
            if not create:
                raise TransportError(
                    f"bucket {plan.index}: a delta, but no base copy of the bucket is held on {device}"
                )
            buf = self._bufs[plan.index] = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
            self._sums.pop(plan.index, None)
        return buf

    def patch(self, sync_id: str, index: int) -> tuple[Applied, int] | None:
        """For an apply strategy: (what the delta wrote, the resulting bucket's checksum) if bucket
        `index` of `sync_id` came as a delta onto a copy with known sums, else None (check it in full)."""
        with self._lock:
            applied = self._patches.pop(index, None) if sync_id == self._sync else None
            if applied is None or applied.sums is None:
                return None
            buf = self._bufs[index]
            n = buf.numel()
            return applied, from_sums(applied.sums, buf[n - n % 4 :], n)

    def sums_keeper(self, sync_id: str, index: int, buf: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
        """Where `buf` is this sync's copy of bucket `index` (what the TCP receiver handed on), a
        function that keeps the word sums an apply strategy's checked copy computed of it, for the
        next delta onto this bucket; else None. Kept only while `sync_id` still owns the copy: this
        sync wrote the bucket before the strategy read it and never writes it again, and a newer
        sync's prepare (which may rewrite it) ends the ownership first."""
        if not self.enabled or sync_id != self._sync:
            return None
        ptr, n = buf.data_ptr(), buf.numel()

        def keep(sums: torch.Tensor) -> None:
            with self._lock:
                held = self._bufs.get(index)
                if (
                    sync_id == self._sync
                    and index in self._written
                    and held is not None
                    and held.data_ptr() == ptr
                    and n >= held.numel()
                    and sums.device == held.device
                ):
                    self._sums[index] = sums

        return keep

    def sparse_ok(self, sync_id: str) -> bool:
        """The engine held exactly the base copy's bytes when `sync_id` was prepared, and the
        sync's deltas apply onto that copy: a delta bucket may be written into the engine as its
        changed words alone."""
        with self._lock:
            return sync_id == self._sync and self._delta_ok and self._engine_was_base

    def engine_wrote(self, sync_id: str, index: int, params: list[torch.Tensor]) -> None:
        """Bucket `index` of `sync_id` went into the engine byte for byte (a checked full copy into
        `params`, parameters of its exact layout, or the changed words of a checked delta onto such
        a copy). A parameter two tensors of the sync write (tied embeddings) holds only the last:
        the engine then does not match the copy."""
        with self._lock:
            if sync_id == self._sync:
                ptrs = {p.data_ptr() for p in params}
                if len(ptrs) < len(params) or ptrs & self._engine_ptrs:
                    self._engine_aliased = True
                self._engine_ptrs |= ptrs
                self._engine_exact.add(index)

    def committed(self, manifest: Manifest) -> None:
        """Sync `manifest` committed: if every bucket of it went through the copy, the copy is its base."""
        with self._lock:
            if manifest.sync_id == self._sync and len(self._written) == len(manifest.buckets):
                self.held = (manifest.origin, manifest.version, manifest.layout_digest)
                self.held_sync = manifest.sync_id
                self.engine_matches = len(self._engine_exact) == len(manifest.buckets) and not self._engine_aliased
            else:
                self.engine_matches = False  # another sync changed the engine
            self._sync, self._patches = "", {}

    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())


class _SyncWriter:
    """One sync's writes into the copy (see TcpBucketReceiver's `base`)."""

    def __init__(self, base: DeltaBase, sync_id: str):
        self.base, self.sync_id = base, sync_id

    def received(self, plan: BucketPlan, dense: torch.Tensor) -> torch.Tensor:
        with self.base._lock:
            src = dense[: plan.nbytes]
            buf = self.base._buffer(self.sync_id, plan, create=True, device=src.device)
            # a plain copy: its word sums come from the apply strategy's checked copy out of `buf`
            # (DeltaBase.sums_keeper), the pass a full sync makes anyway
            self.base._sums.pop(plan.index, None)
            buf.copy_(src)
            self.base._written.add(plan.index)
        return buf

    def patched(self, plan: BucketPlan, payload: torch.Tensor) -> torch.Tensor:
        with self.base._lock:
            buf = self.base._buffer(self.sync_id, plan, create=False, device=payload.device)
            if not self.base._delta_ok:
                raise TransportError(f"bucket {plan.index}: a delta frame, but this rollout refused the delta base")
            try:
                applied = apply_delta(payload, buf, self.base._sums.get(plan.index))
            except BaseException:
                self.base._sums.pop(plan.index, None)  # refused before any write, but keep no doubt
                raise
            if applied.sums is None:
                self.base._sums.pop(plan.index, None)
            else:
                self.base._sums[plan.index] = applied.sums
            self.base._patches[plan.index] = applied
            self.base._written.add(plan.index)
        return buf
