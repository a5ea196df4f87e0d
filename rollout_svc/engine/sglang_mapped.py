"""rollout-svc writes NCCL and TCP buckets into SGLang's parameters itself, through the exported destination table.

Over NCCL or TCP, rollout-svc receives each bucket into a CUDA buffer of its own. Handing that buffer to SGLang's
TP worker (sglang_direct.py, one `update_weights_from_tensor` call per bucket) puts the copy in another CUDA
context on the same GPU: the two contexts are time-sliced, so each copy waits behind the receive of the next bucket,
plus an SGLang RPC per bucket (measured on 2×H200 at 7B: 184.8 ms a sync against 49.7 ms into the built-in engine).
The table sglang_export.py gets from SGLang's worker after the sync that learnt a layout says, per tensor, which
bytes of which parameter storage hold it (byte for byte, or the worker answers UNWRITABLE). This mixin maps those
storages into rollout-svc's process once (CUDA IPC, as the trainer does for its writes, weightsync/bus/ipc/
trainer_writes.py `Destinations`) and offers the views as `writable_params`, exactly as the built-in engine offers
its parameters: the in-place apply (rollout_svc/sync/apply_inplace.py) then writes each received bucket into them
with the copy-and-checksum kernel in rollout-svc's own context. A sync is then begin_apply (SGLang paused), one
copy per bucket, end_apply (flush the radix cache, continue), with no SGLang call per bucket.

The guarantees stay the built-in engine's: the checksum is that of the kernel that wrote SGLang's parameters (the
in-place apply checks it before the commit, so every write has completed before SGLang continues), an abort after
the first bucket leaves the rollout STALE, and the first sync of a layout still goes through SGLang's loader (that
is how the table is learnt). Offered only while an in-place sync holds SGLang paused (begin_apply to end_apply:
the staged apply, which never pauses SGLang, keeps the loader), for tensors a mapped table holds with the exact
dtype and shape (any other bucket goes through the loader), and never where the table is never exported:
with `enable_memory_saver` (its parameters cannot be shared by CUDA IPC and release/resume moves them) or with
`rollout_writes=False` (the debug switch `sglang_rollout_writes`: every bucket through SGLang's worker). At
`tp_size` > 1 each rank's table is of its shards: sglang_shards.py maps and writes those.
The mappings are dropped when SGLang's memory is released and when the engine closes.
"""

from __future__ import annotations

import logging
import math

import torch

from weightsync.bus import dtypes
from weightsync.bus.ipc.handles import open_mapping
from weightsync.bus.plan import TensorMeta

log = logging.getLogger(__name__)


class SglangMappedMixin:
    """Expects SglangExportMixin (`_dest_tables`, `_export_declined`, `drop_destinations`, `close_export`) and
    `opts` (SglangOptions.rollout_writes)."""

    #: maps one allocation of an exported table into this process (CUDA IPC); CPU tests hand a stand-in
    open_allocation = staticmethod(open_mapping)
    #: set by begin_apply, cleared by end_apply: an in-place sync holds SGLang paused
    writing_in_place: bool = False
    #: name -> SGLang's parameter bytes of that tensor, mapped into this process; the ids of the tables mapped
    _mapped_views: dict[str, torch.Tensor] | None = None
    _mapped_ids: set[str] | None = None

    def writable_params(self, metas: list[TensorMeta]) -> list[torch.Tensor] | None:
        """SGLang's parameters of tensors `metas`, mapped from an exported table, while an in-place sync holds
        SGLang paused; None (the bucket goes through SGLang's loader) otherwise or for a tensor no mapped table
        holds with its exact dtype and shape."""
        if not self.writing_in_place or self._rollout_writes_declined():
            return None
        views = self._mapped_views or {}
        out = []
        for m in metas:
            v = views.get(m.name)
            if v is None or v.dtype != m.dtype or tuple(v.shape) != tuple(m.shape):
                return None
            out.append(v)
        return out

    def _rollout_writes_declined(self) -> str:
        if not getattr(self.opts, "rollout_writes", True):
            return "rollout_writes=False"
        return self._export_declined()  # type: ignore[attr-defined]

    def export_after_sync(self) -> None:
        """SglangExportMixin.export_after_sync, then map every table exported and not yet mapped."""
        super().export_after_sync()  # type: ignore[misc]
        if self._rollout_writes_declined():
            return
        if self._mapped_ids is None:
            self._mapped_ids = set()
        mapped = self._mapped_ids
        for got in list((getattr(self, "_dest_tables", None) or {}).values()):
            if got is None or got[0] in mapped:
                continue
            mapped.add(got[0])  # once, mapped or not: a table that failed to map is not tried again
            if isinstance(got[1], list):  # tp_size > 1: one table of shards per TP rank (sglang_shards.py)
                self._map_shards_logged(got[1])
                continue
            try:
                views = self._map_table(got[1])
            except Exception:  # noqa: BLE001 — the sync is written: later syncs go through SGLang's loader
                log.exception("mapping SGLang's exported table failed; its buckets keep going through SGLang's loader")
                continue
            self._mapped_views = {**(self._mapped_views or {}), **views}
            log.warning(
                "SGLang's parameters mapped (%d tensors): rollout-svc writes NCCL/TCP buckets itself", len(views)
            )

    def _map_shards_logged(self, tables: list) -> None:
        try:
            n = self.map_shards(tables)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 — the sync is written: later syncs go through SGLang's loader
            log.exception("mapping SGLang's exported shard tables failed; its buckets keep going through the loader")
            return
        log.warning(
            "SGLang's %d TP ranks' shards mapped (%d layouts): rollout-svc writes NCCL/TCP buckets", len(tables), n
        )

    def _map_table(self, table) -> dict[str, torch.Tensor]:
        """name -> a view of that tensor in SGLang's parameters, in its dtype and shape; ValueError naming the
        tensor when an entry does not fit its allocation."""
        maps = [self.open_allocation(h) for h in table.allocations]
        views: dict[str, torch.Tensor] = {}
        for t in table.tensors:
            if not 0 <= t.allocation < len(maps):
                raise ValueError(f"tensor {t.name}: allocation {t.allocation} of {len(maps)}")
            dtype, shape = dtypes.from_wire(t.dtype), tuple(t.shape)
            size = math.prod(shape) * dtype.itemsize
            whole = maps[t.allocation]
            if t.nbytes != size or t.offset < 0 or t.offset + size > whole.numel() or t.offset % dtype.itemsize:
                raise ValueError(
                    f"tensor {t.name}: {t.nbytes} bytes at offset {t.offset} do not fit {dtype} {list(shape)} "
                    f"inside its allocation of {whole.numel()} bytes"
                )
            views[t.name] = whole[t.offset : t.offset + size].view(dtype).view(shape)
        return views

    def drop_destinations(self) -> None:
        """SglangExportMixin.drop_destinations, and every mapping of SGLang's parameters with them."""
        self.drop_mappings()
        super().drop_destinations()  # type: ignore[misc]

    def drop_mappings(self) -> None:
        self._mapped_views = self._mapped_ids = None
        self.drop_shards()  # type: ignore[attr-defined]

    def close_export(self) -> None:
        self.drop_mappings()
        super().close_export()  # type: ignore[misc]
