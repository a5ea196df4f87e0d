"""Our weight loader inside every SGLang TP worker: a bucket written where SGLang reads, in one launch.

SGLang runs a function of ours in each TP worker when it is registered at start
(`ServerArgs.custom_weight_loader`, a list of import paths) and named as the `load_format` of
`update_weights_from_tensor`: the worker deserialises its rank's payload, moves each tensor to its GPU
(a no-op for ours) and calls `load(model, named_tensors)` (0.5.10 `ModelRunner.update_weights_from_tensor`).
The rollout (sglang_direct.py) sends one or more buckets per call, the same entries to every rank:

  (HEADER + json [seq, layout key, bucket index, nbytes, [[name, shape, dtype, offset], ...]], bucket), ...
  ("ws-result", result of TP rank 0), ("ws-result", result of TP rank 1), ...

`bucket` is the bus buffer as uint8 (colocated: the trainer's own buffer, its CUDA IPC handle forwarded
unopened, so nothing is copied in rollout-svc); `result` is a small int64 tensor of the rollout's that this
function fills (its rank's), a row per bucket: (seq, status, the word sums of the checksum, how). SGLang's hook
returns nothing to the caller, and an exception would stop the scheduler, so the outcome and the sums travel in
`result`; the rollout adds the bucket's last bytes (weightsync/bus/copy/checksum.py `from_sums`).

The slot table. The first bucket of a layout (`key`) goes through SGLang's own `model.load_weights` while a
torch function mode records every `copy_` it makes from the bucket into a parameter. Each copy is a `Piece`
(weightsync/bus/copy/shard_copy.py): the whole tensor, or at `tp_size` > 1 the rank's shard SGLang's layer
narrowed out of it (a row range: one byte range; a column range: rows at the source's stride), into one
contiguous parameter region, checked once against what SGLang's loader left there. Every later bucket of
that layout is written from those regions by one launch of the built-in engine's copy-and-checksum kernel
(weightsync/bus/copy/verified_copy.py `copy_all_into` when every tensor lands whole; shard_copy.py
`copy_sharded_all` when the rank holds shards): the checksum is of the words written into SGLang's parameters.
A rank holding shards reports two pairs of sums, `common` (words every rank reads) and `shard` (its own), that
the rollout combines across ranks (sglang_direct._combined). (Constants SGLang's loader writes, such as the
zeroed spare rows of a padded vocabulary, stay as written.) A layout SGLang's loader does not write that way
(a cast, an in-place op on a parameter, a tensor copied whole twice, a shard edge inside a 4-byte word) keeps
SGLang's loader for good, its checksum read from the whole bucket in the same worker.

Imported by SGLang's worker (`dynamic_import`): torch and the bus's plan and copy modules only.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from weightsync.bus import dtypes
from weightsync.bus.copy import shard_copy
from weightsync.bus.plan import BucketPlan, Slot, TensorMeta

log = logging.getLogger(__name__)

#: what `update_weights_from_tensor(load_format=...)` and `ServerArgs.custom_weight_loader` name
LOADER = "rollout_svc.engine.sglang_loader.load"
HEADER = "ws-bucket:"
#: an entry asking for the slot tables as a destination table (sglang_export.py), not a bucket
EXPORT = "ws-export:"
RESULT = "ws-result"
#: a result row per bucket: (seq, status, word sum, word sum of squares, how, the call's time in the worker (ns),
#: the shard's word sum, its sum of squares, the bucket's bytes this rank read). Sums: of the whole bucket (shard
#: sums 0), or of a TP rank's `common` and `shard` words (weightsync/bus/copy/shard_copy.py)
RESULT_WORDS = 9
#: row[1]
OK, FAILED = 1, 2
#: row[4]: how the bucket was written
BY_TABLE, BY_SGLANG, LEARNED = 1, 2, 3


def _slots(plan: BucketPlan) -> list:
    return [[s.meta.name, list(s.meta.shape), dtypes.to_wire(s.meta.dtype), s.offset] for s in plan.slots]


def layout_key(plan: BucketPlan) -> str:
    """What names bucket `plan`'s layout (its slot table) in the workers: its tensors, their places, its size."""
    text = json.dumps(_slots(plan), separators=(",", ":"))
    return hashlib.sha1(f"{plan.nbytes}:{text}".encode()).hexdigest()[:20]


def header(seq: int, plan: BucketPlan) -> str:
    """The first entry's name: the bucket's layout, in what `load` reads."""
    return HEADER + json.dumps([seq, layout_key(plan), plan.index, plan.nbytes, _slots(plan)], separators=(",", ":"))


def read_header(name: str) -> tuple[int, str, BucketPlan]:
    """(seq, layout key, the bucket's plan) from `header`'s text."""
    if not name.startswith(HEADER):
        raise ValueError(f"{LOADER}: the first entry must be the bucket header ({HEADER}...), got {name[:40]!r}")
    seq, key, index, nbytes, slots = json.loads(name[len(HEADER) :])
    plan = BucketPlan(index=int(index))
    for n, shape, dt, off in slots:
        plan.slots.append(Slot(TensorMeta(n, tuple(shape), dtypes.from_wire(dt)), int(off)))
    plan.nbytes = int(nbytes)
    return int(seq), str(key), plan


@dataclass
class Table:
    """Where each slot of one bucket layout lies in SGLang's parameters: `dests` (one whole region per slot), or
    `pieces` (a TP rank's shards, weightsync/bus/copy/shard_copy.py); both None: SGLang's loader writes it."""

    plan: BucketPlan
    dests: list[torch.Tensor] | None
    why: str = ""
    pieces: list[shard_copy.Piece] | None = None

    @property
    def replays(self) -> bool:
        return self.dests is not None or self.pieces is not None

    @functools.cached_property
    def bytes_read(self) -> int:
        return shard_copy.bytes_read(self.plan, self.pieces or [])


def load(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang's custom-weight-loader hook (see the module docstring). Never raises: a failure is
    reported in the result tensor (and logged here), the rollout then aborts the sync."""
    buckets = [(n, t) for n, t in named_tensors if isinstance(n, str) and n.startswith(HEADER)]
    results = [t for n, t in named_tensors if n == RESULT]
    if not results:
        log.error("%s: no %r entry to report into; nothing loaded", LOADER, RESULT)
        return
    result = results[_tp_rank() if len(results) > 1 else 0].view(-1, RESULT_WORDS)
    exports = [n for n, _ in named_tensors if isinstance(n, str) and n.startswith(EXPORT)]
    if exports:  # not a load: where the slot tables write, for the trainer to write there (sglang_export.py)
        _export(model, exports[0][len(EXPORT) :], result, _tp_rank() if len(results) > 1 else 0)
        return
    t0 = time.perf_counter_ns()
    rows = torch.zeros(len(buckets), RESULT_WORDS, dtype=torch.int64)
    sums: list[torch.Tensor | None] = [None] * len(buckets)
    batch: list[tuple[int, BucketPlan, torch.Tensor, Table]] = []
    for i, (name, bucket) in enumerate(buckets):
        try:
            seq, key, plan = read_header(name)
            rows[i, 0] = seq
            table = _table(model, key, plan, bucket)
            rows[i, 8] = plan.nbytes
            if table is None:  # learnt now: SGLang's loader wrote it
                sums[i], rows[i, 4] = _word_sums(bucket, plan), LEARNED
            elif not table.replays:
                model.load_weights(views(plan, bucket))
                sums[i], rows[i, 4] = _word_sums(bucket, plan), BY_SGLANG
            else:
                batch.append((i, plan, bucket, table))
                if table.pieces is not None:
                    rows[i, 8] = table.bytes_read
            _hold(bucket)
            rows[i, 1] = OK
        except Exception:  # noqa: BLE001 — reported through `result`; raising would stop SGLang's scheduler
            log.exception("%s: bucket %d of this call was not loaded", LOADER, i)
            rows[i, 1] = FAILED
            break
    try:
        written = _write_batch(model, batch, rows, sums)
    except Exception:  # noqa: BLE001 — as above
        log.exception("%s: the slot tables' copy failed", LOADER)
        written = False
    if not written:
        rows[[i for i, *_ in batch], 1] = FAILED
    if len(buckets) > result.shape[0]:
        log.error("%s: %d buckets, room to report %d", LOADER, len(buckets), result.shape[0])
        return
    out = result[: len(buckets)]
    out.copy_(rows)
    for i, got in enumerate(sums):
        if got is not None and rows[i, 1] == OK:
            got = got.view(-1, 2)  # [whole] or [common, shard]
            out[i, 2:4].copy_(got[0])
            if got.shape[0] > 1:
                out[i, 6:8].copy_(got[1])
    if out.is_cuda:
        # the rollout reads it after SGLang's reply, from another process: nothing may still be queued
        torch.cuda.current_stream(out.device).synchronize()
        out[:, 5].fill_(time.perf_counter_ns() - t0)
        torch.cuda.current_stream(out.device).synchronize()


def _export(model: torch.nn.Module, text: str, result: torch.Tensor, rank: int) -> None:
    """An export call (sglang_export_worker.py) at TP rank `rank`, reported in `result`'s first row: (seq,
    status, the table file's size, 0, how, the worker's time)."""
    from rollout_svc.engine import sglang_export_worker as worker

    t0 = time.perf_counter_ns()
    row = torch.zeros(RESULT_WORDS, dtype=torch.int64)
    try:
        row[0] = worker.seq_of(text)
        row[4], row[2] = worker.export(model, text, rank)
        row[1] = OK
    except Exception:  # noqa: BLE001 — reported through `result`; raising would stop SGLang's scheduler
        log.exception("%s: exporting the slot tables failed", LOADER)
        row[1] = FAILED
    _report(result[:1], row.view(1, -1), t0)


def _report(out: torch.Tensor, rows: torch.Tensor, t0: int) -> None:
    out.copy_(rows)
    if out.is_cuda:
        # the rollout reads it after SGLang's reply, from another process: nothing may still be queued
        torch.cuda.current_stream(out.device).synchronize()
        out[:, 5].fill_(time.perf_counter_ns() - t0)
        torch.cuda.current_stream(out.device).synchronize()


def _table(model: torch.nn.Module, key: str, plan: BucketPlan, bucket: torch.Tensor) -> Table | None:
    """The slot table of layout `key`; None when it was unknown: learnt now, the bucket written by SGLang's loader."""
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() < plan.nbytes:
        raise ValueError(
            f"bucket {plan.index}: expected a flat uint8 buffer of at least {plan.nbytes} bytes, "
            f"got {bucket.dtype} {list(bucket.shape)}"
        )
    tables: dict[str, Table] = model.__dict__.setdefault("_ws_slot_tables", {})
    table = tables.get(key)
    if table is None:
        tables[key] = table = learn(model, plan, bucket)
        if not table.replays:
            log.warning("bucket layout %s: SGLang's loader keeps writing it (%s)", key, table.why)
        return None
    return table


def _write_batch(model: torch.nn.Module, batch: list, rows: torch.Tensor, sums: list) -> bool:
    """Write the buckets of `batch` [(row, plan, bucket, table)] by their slot tables: queued back to back on
    the current stream (weightsync/bus/copy/verified_copy.py `copy_all_into`, the built-in engine's trainer_writes
    copy; a TP rank's shards by shard_copy.py `copy_sharded_all`); False when the copy declined them (nothing
    written)."""
    from weightsync.bus.copy.verified_copy import copy_all_into

    whole = [b for b in batch if b[3].pieces is None]
    if whole:
        prepared = model.__dict__.setdefault("_ws_prepared", {})
        pending = copy_all_into(
            [b[1] for b in whole], [b[2] for b in whole], [b[3].dests for b in whole], prepared=prepared
        )
        if pending is None:
            log.error("%s: the copy declined the slot tables' destinations; nothing written", LOADER)
            return False
        for (i, *_), p in zip(whole, pending):
            sums[i], rows[i, 4] = p.sums, BY_TABLE
    shards = [b for b in batch if b[3].pieces is not None]
    if shards:
        from weightsync.bus.copy.shard_copy import copy_sharded_all

        prepared = model.__dict__.setdefault("_ws_prepared_shards", {})
        key = tuple((b[1].index, b[1].nbytes, b[2].data_ptr()) for b in shards)
        if key not in prepared and len(prepared) >= 8:
            prepared.clear()
        got = copy_sharded_all(
            [b[1] for b in shards], [b[2] for b in shards], [b[3].pieces for b in shards], prepared.setdefault(key, {})
        )
        for k, (i, *_) in enumerate(shards):
            sums[i], rows[i, 4] = got[k], BY_TABLE
    return True


def views(plan: BucketPlan, bucket: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views (what SGLang's flattened-bucket path hands `load_weights`)."""
    out = []
    for s in plan.slots:
        m = s.meta
        out.append((m.name, bucket[s.offset : s.offset + m.nbytes].view(m.dtype).view(m.shape)))
    return out


def learn(model: torch.nn.Module, plan: BucketPlan, bucket: torch.Tensor) -> Table:
    """Load the bucket with SGLang's own loader, recording its copies; the table if they fit (module docstring)."""
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    base, end = bucket.data_ptr(), bucket.data_ptr() + plan.nbytes
    with CopyTrace(storages, base, end) as trace:
        model.load_weights(views(plan, bucket))
    if trace.foreign:
        return Table(plan, None, trace.foreign)
    pieces = []
    for dst, src in trace.copies:
        piece = _piece(plan, bucket, base, dst, src)
        if isinstance(piece, str):
            return Table(plan, None, piece)
        pieces.append(piece)
    copied = {p.slot for p in pieces}
    missing = [s.meta.name for i, s in enumerate(plan.slots) if i not in copied]
    if missing:
        return Table(plan, None, f"{missing[0]}: SGLang's loader did not copy it ({len(missing)} such tensors)")
    why = shard_copy.check(plan, pieces)
    if why:
        return Table(plan, None, why)
    if shard_copy.sharded_slots(plan, pieces):
        return Table(plan, None, pieces=pieces)
    dests: list = [None] * len(plan.slots)
    for p in pieces:
        dests[p.slot] = p.dst.view(plan.slots[p.slot].meta.shape)
    return Table(plan, dests)


def _piece(plan: BucketPlan, bucket: torch.Tensor, base: int, dst: torch.Tensor, src: torch.Tensor):
    """The Piece of one recorded `dst.copy_(src)` (`src` a view of the bucket: the whole tensor, a row range,
    or a column range), checked against what SGLang's loader left in `dst`; or why it cannot be replayed."""
    off = src.data_ptr() - base
    i = bisect.bisect_right([s.offset for s in plan.slots], off) - 1
    slot = plan.slots[i] if i >= 0 else None
    if slot is None or off >= slot.offset + slot.meta.nbytes:
        return f"SGLang's loader copied from bucket byte {off}, outside every tensor"
    name = slot.meta.name
    if src.dtype != slot.meta.dtype or dst.dtype != src.dtype or dst.numel() != src.numel():
        return f"{name}: SGLang's loader copies {list(src.shape)} {src.dtype} into {list(dst.shape)} {dst.dtype}"
    if not dst.is_contiguous():
        return f"{name}: SGLang's loader copies into a strided region of a parameter"
    rows = _rows(src)
    if rows is None:
        return f"{name}: SGLang's loader copies a region of {list(src.shape)} strides {src.stride()} (not rows)"
    n, row_elems, stride_elems = rows
    size = src.element_size()
    dest = dst.detach()
    if not torch.equal(_bytes(dest), _bytes(src)):
        return f"{name}: SGLang's parameter does not hold the bucket's bytes after its loader"
    return shard_copy.Piece(i, off, n, row_elems * size, stride_elems * size, dest)


def _rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """`t` as (rows, elements per row, elements between rows) when its elements are rows of contiguous
    elements at one stride (a whole tensor is one row), else None."""
    dims = [(n, st) for n, st in zip(t.shape, t.stride()) if n != 1]
    inner, k = 1, len(dims)
    while k and dims[k - 1][1] == inner:  # the contiguous innermost dims: one row
        inner *= dims[k - 1][0]
        k -= 1
    if k == 0:
        return 1, inner, inner
    n, stride = dims[k - 1]
    for j in range(k - 1, 0, -1):  # the outer dims must step through rows at one stride
        if dims[j - 1][1] != dims[j][1] * dims[j][0]:
            return None
        n *= dims[j - 1][0]
    return n, inner, stride


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


_CONSTANT_FILLS = ("fill_", "zero_")


class CopyTrace(TorchFunctionMode):
    """Records `dst.copy_(src)` calls whose source lies in [base, end) (the bucket) and whose destination is a
    parameter's storage; a write of a constant (`fill_`, `zero_`) is left in place; any other write into a
    parameter makes the trace `foreign` (the table cannot replay it)."""

    def __init__(self, storages: set[int], base: int, end: int):
        super().__init__()
        self.storages, self.base, self.end = storages, base, end
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fills = 0
        self.foreign = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        writes = name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))
        if writes and args and isinstance(args[0], torch.Tensor):
            if args[0].untyped_storage().data_ptr() in self.storages:
                self._write(name, args[0], args)
        return func(*args, **kwargs)

    def _write(self, name: str, dst: torch.Tensor, args) -> None:
        src = args[1] if len(args) > 1 else None
        if name == "copy_" and isinstance(src, torch.Tensor) and self.base <= src.data_ptr() < self.end:
            self.copies.append((dst, src))
        elif name in _CONSTANT_FILLS and (src is None or isinstance(src, (int, float, bool))):
            # a constant written the same at every load (a padded vocabulary's spare rows zeroed): it stays
            # in place between syncs, and a copy over it is still checked against the bucket (`learn`)
            self.fills += 1
        elif not self.foreign:
            self.foreign = f"SGLang's loader wrote a parameter with {name} from outside the bucket"


#: the buckets of recent calls, kept mapped: the trainer pushes the same few buffers at every sync, and torch
#: maps a CUDA IPC handle again (cudaIpcOpenMemHandle) unless a tensor on it is still alive in this process
_HELD: dict[int, torch.Tensor] = {}
HELD_BUFFERS = 64


def _hold(bucket: torch.Tensor) -> None:
    if not bucket.is_cuda:
        return
    key = bucket.untyped_storage().data_ptr()
    _HELD.pop(key, None)
    _HELD[key] = bucket
    while len(_HELD) > HELD_BUFFERS:
        _HELD.pop(next(iter(_HELD)))


def _tp_rank() -> int:
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _word_sums(bucket: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    from weightsync.bus.copy.checksum import word_sums

    whole = plan.nbytes - plan.nbytes % 4
    return word_sums(bucket[:whole].view(torch.int32))
