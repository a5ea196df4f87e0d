"""The trainer writes into SGLang's parameters: our slot tables exported as a CUDA IPC destination table.

Once every bucket layout of a sync has a slot table in SGLang's TP worker (sglang_loader.py: where each of a
bucket's tensors lies in SGLang's parameters, byte for byte), that worker can say where the trainer should
write: CUDA IPC handles of the parameters' storages plus, per manifest tensor, (allocation, offset, nbytes,
dtype, shape) — the `IpcDestinations` the built-in engine offers from `writable_params`
(weightsync/bus/ipc/trainer_writes.py `offer`). The parameters live in SGLang's scheduler process, so the
worker builds and shares the table there (sglang_export_worker.py), asked by an
`update_weights_from_tensor(load_format=LOADER)` call whose first entry is an export request instead of a
bucket; it writes the serialized table into a file of a private directory of rollout-svc's (mode 0700, one file
per call, written under another name and renamed, so rollout-svc never reads half a table; read and removed at
once: a file, not a result tensor, because the table's size is not known before) and its outcome into the usual
result row:

  (seq, status, the file's size, 0, how: EXPORTED | UNLEARNED | UNWRITABLE, worker time)

rollout-svc asks once per set of layouts, at the end of the sync that learnt them (`export_after_sync`, while
SGLang is still paused: a call made while requests run would wait for them behind SGLang's model-update lock),
and keeps the answer; PrepareSync then offers it (`ipc_destinations`, asked by weightsync/bus/ipc/receiver.py
for an engine that `exports_destinations`) exactly as the built-in engine's table, and the trainer writes
every later sync of that layout itself (route `ipc/trainer_writes/...`, the same checksum guarantee).
rollout-svc maps the same table itself for NCCL and TCP syncs (sglang_mapped.py).

At `tp_size` > 1 each TP rank exports a table of its own shards (sglang_export_worker.py, one file per rank):
rollout-svc maps those for its NCCL/TCP writes (sglang_shards.py); they are never offered to the trainer (its
write pass takes one target's table of whole tensors).

Never offered: with `enable_memory_saver` (SGLang's parameters are virtual-memory allocations that torch cannot
export, and release/resume would move them), with `tp_size` > 1 (above), for a quantized manifest, or a layout
SGLang's loader writes in a way a table cannot say (a cast: `UNWRITABLE`). The table is valid as long as SGLang's
parameters stay where they are: they are allocated once and written in place by every path this adapter drives;
a restarted engine is a new `SglangEngine` with no tables (and every table carries a fresh token, as the
built-in engine's), and `release_memory` forgets them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import uuid

import torch

from rollout_svc.engine import sglang_loader as sl
from rollout_svc.engine.sglang_export_worker import (
    EXPORTED,
    MAX_TABLE_BYTES,
    UNLEARNED,
    request,
    table_path,
)

log = logging.getLogger(__name__)
#: export calls for one set of layouts whose answer was UNLEARNED before it is given up
EXPORT_TRIES = 3


# ---- in rollout-svc ----------------------------------------------------------------------------------------------
class SglangExportMixin:
    """Expects what SglangDirectMixin does (`_sgl`, `tp_size`, `_call`, `opts`, `_rows`, `_direct_seq`,
    `direct_cpu`, the per-sync `sync_layouts`)."""

    #: weightsync/bus/ipc/receiver.py asks `ipc_destinations` instead of `writable_params`
    exports_destinations = True
    _export_dir: str = ""

    def ipc_destinations(self, manifest) -> tuple[str, object] | None:
        """(table id, IpcDestinations) of where `manifest`'s tensors lie in SGLang's parameters, or None: not
        exported (yet). Never a call into SGLang: the table was exported at the end of the sync that learnt it."""
        if self.tp_size != 1 or self._export_declined(manifest.quantization is not None):
            return None  # tp_size > 1: each rank's table is of its shards, for rollout-svc's writes only
        return (getattr(self, "_dest_tables", None) or {}).get(self._layout_keys(manifest))

    def _layout_keys(self, manifest) -> tuple[str, ...]:
        """The workers' layout keys of `manifest`'s buckets, computed once per layout digest (every prepare asks)."""
        known = self.__dict__.setdefault("_keys_by_digest", {})
        keys = known.get(manifest.layout_digest) if manifest.layout_digest else None
        if keys is None:
            keys = tuple(sl.layout_key(plan) for plan in manifest.buckets)
            if manifest.layout_digest:
                if len(known) >= 8:
                    known.clear()
                known[manifest.layout_digest] = keys
        return keys

    def _export_declined(self, quantized: bool = False) -> str:
        o = self.opts
        if not getattr(o, "direct_loader", False):
            return "our loader is off (direct_loader=False)"
        if getattr(o, "colocated", False):
            return "enable_memory_saver: SGLang's parameters cannot be shared by CUDA IPC"
        if quantized:
            return "a quantized manifest"
        return ""

    def export_after_sync(self) -> None:
        """At the end of a sync (SGLang paused): export the tables of its layouts if every bucket went through
        our loader and they were not asked for yet. Once per set of layouts (a few tries where a worker had not
        learnt them all: SGLang's loader wrote a bucket that failed, say)."""
        got = getattr(self, "sync_layouts", None) or {}
        if not got or sorted(got) != list(range(len(got))) or self._export_declined():
            return
        keys = tuple(got[i] for i in range(len(got)))
        tables = self.__dict__.setdefault("_dest_tables", {})
        if keys in tables:
            return
        tries = self.__dict__.setdefault("_export_tries", {})
        tries[keys] = tries.get(keys, 0) + 1
        try:
            with self.timed("export"):
                table, final = self._export(keys)
        except Exception:  # noqa: BLE001 — the sync itself is written: only the trainer's later writes are lost
            log.exception("exporting SGLang's slot tables failed; the trainer will not write into SGLang")
            table, final = None, True
        if final or tries[keys] >= EXPORT_TRIES:
            if len(tables) >= 4:  # layouts change rarely
                tables.clear()
            tables[keys] = table

    def _export(self, keys: tuple[str, ...]) -> tuple[tuple[str, object] | None, bool]:
        """One export call: ((table id, table) or None, whether that answer is final for `keys`)."""
        from rollout_svc.engine.sglang_weights import check_result

        self._direct_seq += 1
        seq = self._direct_seq
        out_dir = self._private_dir()
        sharded = self.tp_size > 1
        rows = self._rows(1)
        ask = torch.zeros(1, dtype=torch.uint8, device=rows[0].device)  # SGLang moves every entry's tensor
        entries = [(sl.EXPORT + request(seq, out_dir, list(keys), sharded), ask), *[(sl.RESULT, r) for r in rows]]
        try:
            res = self._call(
                self._sgl.update_weights_from_tensor, named_tensors=entries, load_format=sl.LOADER, flush_cache=False
            )
            check_result(res, f"update_weights_from_tensor({sl.LOADER}, export)")
            answers = [r[0].tolist()[:5] for r in rows]  # one row per TP rank
            for rank, (s, status, _, _, _) in enumerate(answers):
                if s != seq or status != sl.OK:
                    what = "no answer" if s != seq else "failed: the scheduler's log names the error"
                    log.error("exporting SGLang's slot tables: TP rank %d %s; rollout-svc keeps the loader", rank, what)
                    return None, True
            hows = {a[4] for a in answers}
            if UNLEARNED in hows:
                return None, False
            if hows != {EXPORTED}:
                log.warning(
                    "SGLang's loader writes a layout of this model itself (the scheduler's log says why): "
                    "its slot tables are not exported"
                )
                return None, True
            paths = [table_path(out_dir, seq, r if sharded else None) for r in range(len(rows))]
            tables = [self._read_table(path, a[2]) for path, a in zip(paths, answers)]
        finally:
            for r in range(len(rows)):  # whatever a rank wrote and was not read (removed as it is read)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(table_path(out_dir, seq, r if sharded else None))
        if any(t is None for t in tables):
            return None, True
        digest = hashlib.sha256(b"".join(t.SerializeToString() for t in tables)).hexdigest()[:24]
        # SGLang's Engine sets the root logger to its own level: warning, so that it shows
        log.warning(
            "SGLang's slot tables exported (%d TP ranks, %d entries, %d allocations)",
            len(tables),
            sum(len(t.tensors) for t in tables),
            sum(len(t.allocations) for t in tables),
        )
        # a fresh token per table, as the built-in engine's: another engine's table is never taken for this one
        return (f"sglang-{digest}-{uuid.uuid4().hex[:16]}", tables if sharded else tables[0]), True

    @staticmethod
    def _read_table(path: str, size: int):
        """The IpcDestinations in `path` (removed once read), or None when it is not `size` bytes."""
        from weightsync.v1 import bus_pb2

        try:
            if not 0 < size <= MAX_TABLE_BYTES or os.path.getsize(path) != size:
                log.error("the exported table %s is not the %d bytes the worker reported", path, size)
                return None
            with open(path, "rb") as f:
                return bus_pb2.IpcDestinations.FromString(f.read())
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def _private_dir(self) -> str:
        if not self._export_dir or not os.path.isdir(self._export_dir):
            self._export_dir = tempfile.mkdtemp(prefix="ws-sglang-tables-")  # mode 0700
        return self._export_dir

    def drop_destinations(self) -> None:
        """Forget every exported table (SGLang's memory is released: its parameters may move)."""
        self.__dict__.pop("_dest_tables", None)

    def release_memory(self, *args, **kwargs):
        """SglangWeightsMixin.release_memory (its answer: the tags released), forgetting every exported table
        first: SGLang may move what it releases (never offered with enable_memory_saver anyway)."""
        self.drop_destinations()
        return super().release_memory(*args, **kwargs)  # type: ignore[misc]

    def close_export(self) -> None:
        """Remove the private directory (empty unless a call failed between the worker's write and our read)."""
        if self._export_dir:
            shutil.rmtree(self._export_dir)
            self._export_dir = ""
