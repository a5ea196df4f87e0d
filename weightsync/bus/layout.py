"""Manifest layouts named by digest: plan a layout once, send it in full once, then only its name.

A sync's layout — which tensor sits where in which bucket — follows from the export metadata,
the bucket size, the model family and the checksum algorithm alone, so it is the same from one
sync to the next while the model is unchanged. Planning it, encoding it and validating its few
hundred entries on every rollout for every sync would be most of a sync's fixed cost. So:

- the trainer plans a layout once and keeps it while the metadata is unchanged (`ManifestCache`),
  sends the full manifest to a rollout once per layout, and thereafter only the layout's digest;
- the rollout keeps every layout it has validated under its digest (`KnownLayouts`) and answers a
  digest it does not hold (it restarted, the layout changed, the entry aged out) with
  `manifest_needed`, upon which the trainer sends the full manifest.

The rollout computes the digest of every full manifest itself and refuses one that claims another
digest, so a digest only ever names the buckets it was computed from. A changed layout has a new
digest by construction: nothing is ever applied under a stale layout.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from weightsync.bus import dtypes
from weightsync.bus.plan import (
    Manifest,
    Quantization,
    TensorMeta,
    bulk,
    make_manifest,
    manifest_from_proto,
    manifest_to_proto,
)
from weightsync.bus.runs import manifest_to_proto_runs
from weightsync.v1 import bus_pb2

DIGEST_SCHEME = "ws-layout-v1"


def layout_digest(m: Manifest) -> str:
    """sha256 (hex) of everything in `m` that is not per-sync (version, sync id, origin are not)."""
    q = m.quantization
    # Quantization changes how a rollout reads the bytes (which tensors are scales): it is layout.
    quant = "" if q is None else f"{q.method}\0{q.fmt}\0{tuple(q.weight_block_size)}"
    parts = [f"{DIGEST_SCHEME}\0{m.bucket_bytes}\0{m.total_bytes}\0{m.model_family}\0{m.checksum_algo}\0{quant}"]
    # each tensor's line is name, wire dtype, shape, offset; the middle of it is formatted once per (dtype, shape):
    # a MoE manifest has a handful of those over 100,000 tensors
    middles: dict[tuple, str] = {}
    add = parts.append
    for b in m.buckets:
        # the sender of each bucket is layout too: a rollout expects each sender's buckets, in its
        # order, on that sender's own stream
        add(f"#{b.index}\0{b.nbytes}\0{b.sender}")
        for s in b.slots:
            t = s.meta
            mid = middles.get((t.dtype, t.shape))
            if mid is None:
                mid = middles[(t.dtype, t.shape)] = f"\0{dtypes.to_wire(t.dtype)}\0{t.shape}\0"
            add(f"{t.name}{mid}{s.offset}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def compact_proto(m: Manifest) -> bus_pb2.Manifest:
    """The manifest without its buckets: the layout travels as `layout_digest`."""
    if not m.layout_digest:
        raise ValueError("a compact manifest needs manifest.layout_digest (plan it with ManifestCache)")
    return bus_pb2.Manifest(
        version=m.version,
        sync_id=m.sync_id,
        bucket_bytes=m.bucket_bytes,
        total_bytes=m.total_bytes,
        model_family=m.model_family,
        checksum_algo=m.checksum_algo,
        origin=m.origin,
        layout_digest=m.layout_digest,
    )


class ManifestCache:
    """The trainer's side: one planned layout (the current one) and which rollout holds it.

    `manifest()` re-plans only when the export metadata, bucket size, family, checksum algorithm,
    quantization or the tensors' senders differ from the cached layout's; a hit costs one comparison of the
    metadata list (an identity
    check when the actor hands back the same list).
    """

    def __init__(self):
        self._key: tuple | None = None
        self._metas: list[TensorMeta] | None = None
        self._template: Manifest | None = None
        self._full: dict[bool, bus_pb2.Manifest] = {}  # runs? -> the layout's full manifest, encoded once
        self._known: dict[tuple[str, str], str] = {}  # (rollout_id, address) -> digest it validated
        self.plans = 0  # layouts planned (tests and metrics: 1 while the model is unchanged)

    def manifest(
        self,
        metas: list[TensorMeta],
        *,
        version: int,
        sync_id: str,
        bucket_bytes: int,
        model_family: str = "",
        checksum_algo: str = "",
        origin: str = "",
        quantization: Quantization | None = None,
        owners: list[int] | None = None,
    ) -> Manifest:
        # owners: each tensor's sender rank (None: one sender, rank 0), as for make_manifest
        key = (bucket_bytes, model_family, checksum_algo, quantization, tuple(owners) if owners else None)
        if self._template is None or key != self._key or not (metas is self._metas or metas == self._metas):
            with bulk():
                # the per-sync fields (version, sync id, origin) are left empty: for_sync sets them
                template = make_manifest(
                    list(metas),
                    version=0,
                    sync_id="",
                    bucket_bytes=bucket_bytes,
                    model_family=model_family,
                    checksum_algo=checksum_algo,
                    quantization=quantization,
                    owners=owners,
                )
                template.layout_digest = layout_digest(template)
            self._key, self._metas, self._template, self._full = key, metas, template, {}
            self.plans += 1
        # The bucket plans are shared, never mutated after planning; only the per-sync fields differ.
        return self._template.for_sync(version, sync_id, origin)

    def full_proto(self, m: Manifest, *, runs: bool = False) -> bus_pb2.Manifest:
        """The full manifest of `m` (encoded once per layout and form, then copied with the sync's fields);
        `runs`: alike blocks of tensors (a layer's experts) as run entries, for a rollout that reads them."""
        encode = manifest_to_proto_runs if runs else manifest_to_proto
        if self._template is None or m.layout_digest != self._template.layout_digest:
            return encode(m)
        if runs not in self._full:
            with bulk():
                self._full[runs] = encode(self._template)
        msg = bus_pb2.Manifest()
        msg.CopyFrom(self._full[runs])
        msg.version, msg.sync_id, msg.origin = m.version, m.sync_id, m.origin
        return msg

    @staticmethod
    def _who(entry) -> tuple[str, str]:
        return entry.rollout_id, entry.address

    def holds(self, entry, digest: str) -> bool:
        """True when `entry` validated the layout `digest` (a compact manifest will do)."""
        return bool(digest) and self._known.get(self._who(entry)) == digest

    def learned(self, entry, digest: str) -> None:
        self._known[self._who(entry)] = digest

    def forget(self, entry) -> None:
        self._known.pop(self._who(entry), None)


class KnownLayouts:
    """The rollout's side: layouts it validated, by digest (the most recent `capacity` of them)."""

    def __init__(self, capacity: int = 4):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._by_digest: OrderedDict[str, Manifest] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_digest)

    def manifest_of(self, msg: bus_pb2.Manifest) -> Manifest | None:
        """The manifest `msg` stands for; None when it names by digest a layout not held here.

        A full manifest is validated (manifest_from_proto) and its digest computed here; a
        compact one takes the held layout and must agree with it on every layout-wide field.
        """
        if msg.buckets or not msg.layout_digest:
            with bulk():
                m = manifest_from_proto(msg)
                digest = layout_digest(m)
            if msg.layout_digest and msg.layout_digest != digest:
                raise ValueError(
                    f"manifest.layout_digest={msg.layout_digest} does not match its buckets "
                    f"(computed {digest}); the trainer's layout cache is inconsistent"
                )
            m.layout_digest = digest
            return m
        held = self._by_digest.get(msg.layout_digest)
        if held is None:
            return None
        if not msg.sync_id:
            raise ValueError("manifest.sync_id is empty")
        for name in ("bucket_bytes", "total_bytes", "model_family", "checksum_algo"):
            if getattr(msg, name) != getattr(held, name):
                raise ValueError(
                    f"manifest.{name}={getattr(msg, name)!r} differs from the layout "
                    f"{msg.layout_digest[:12]}… it names ({getattr(held, name)!r})"
                )
        self._by_digest.move_to_end(msg.layout_digest)
        return held.for_sync(msg.version, msg.sync_id, msg.origin)

    def remember(self, m: Manifest) -> None:
        """Keep `m`'s layout; call only once the engine has accepted it (SyncTransaction.validate)."""
        if not m.layout_digest:
            return
        self._by_digest[m.layout_digest] = m
        self._by_digest.move_to_end(m.layout_digest)
        while len(self._by_digest) > self.capacity:
            self._by_digest.popitem(last=False)
