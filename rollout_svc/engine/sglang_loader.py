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
torch function mode records every `copy_` it makes. Where each of the bucket's tensors went into exactly one
contiguous region of one parameter, byte for byte (the fused `qkv_proj` / `gate_up_proj` rows of a TP=1
worker, the embedding's first rows of a padded vocabulary, ...), those regions are the table, checked once
against what SGLang's loader left there. Every later bucket of that layout is written by one launch of the
built-in engine's copy-and-checksum kernel (weightsync/bus/copy/verified_copy.py `copy_into`) straight into those
regions: the checksum is of the words written into SGLang's parameters. (Constants SGLang's loader writes,
such as the zeroed spare rows of a padded vocabulary, stay as written.) A layout SGLang's loader does not write
that way (a TP shard narrowed out of a tensor, a cast, an in-place op on a parameter, a tensor copied twice)
keeps SGLang's loader for good, its checksum read from the bucket in the same worker.

Imported by SGLang's worker (`dynamic_import`): torch and the bus's plan and copy modules only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from weightsync.bus import dtypes
from weightsync.bus.plan import BucketPlan, Slot, TensorMeta

log = logging.getLogger(__name__)

#: what `update_weights_from_tensor(load_format=...)` and `ServerArgs.custom_weight_loader` name
LOADER = "rollout_svc.engine.sglang_loader.load"
HEADER = "ws-bucket:"
#: an entry asking for the slot tables as a destination table (sglang_export.py), not a bucket
EXPORT = "ws-export:"
RESULT = "ws-result"
#: a result row per bucket: (seq, status, word sum, word sum of squares, how, the call's time in the worker, ns)
RESULT_WORDS = 6
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
    """Where each slot of one bucket layout lies in SGLang's parameters (None: SGLang's loader writes it)."""

    plan: BucketPlan
    dests: list[torch.Tensor] | None
    why: str = ""


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
        _export(model, exports[0][len(EXPORT) :], result)
        return
    t0 = time.perf_counter_ns()
    rows = torch.zeros(len(buckets), RESULT_WORDS, dtype=torch.int64)
    sums: list[torch.Tensor | None] = [None] * len(buckets)
    batch: list[tuple[int, BucketPlan, torch.Tensor, list[torch.Tensor]]] = []
    for i, (name, bucket) in enumerate(buckets):
        try:
            seq, key, plan = read_header(name)
            rows[i, 0] = seq
            table = _table(model, key, plan, bucket)
            if table is None:  # learnt now: SGLang's loader wrote it
                sums[i], rows[i, 4] = _word_sums(bucket, plan), LEARNED
            elif table.dests is None:
                model.load_weights(views(plan, bucket))
                sums[i], rows[i, 4] = _word_sums(bucket, plan), BY_SGLANG
            else:
                batch.append((i, plan, bucket, table.dests))
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
            out[i, 2:4].copy_(got.view(torch.int64))
    if out.is_cuda:
        # the rollout reads it after SGLang's reply, from another process: nothing may still be queued
        torch.cuda.current_stream(out.device).synchronize()
        out[:, 5].fill_(time.perf_counter_ns() - t0)
        torch.cuda.current_stream(out.device).synchronize()


def _export(model: torch.nn.Module, text: str, result: torch.Tensor) -> None:
    """An export call (sglang_export_worker.py), reported in `result`'s first row: (seq, status, the table
    file's size, 0, how, the worker's time)."""
    from rollout_svc.engine import sglang_export_worker as worker

    t0 = time.perf_counter_ns()
    row = torch.zeros(RESULT_WORDS, dtype=torch.int64)
    try:
        row[0] = worker.seq_of(text)
        row[4], row[2] = worker.export(model, text)
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
        if table.dests is None:
            log.warning("bucket layout %s: SGLang's loader keeps writing it (%s)", key, table.why)
        return None
    return table


def _write_batch(model: torch.nn.Module, batch: list, rows: torch.Tensor, sums: list) -> bool:
    """Write the buckets of `batch` [(row, plan, bucket, dests)] by their slot tables: queued back to back on
    the current stream (weightsync/bus/copy/verified_copy.py `copy_all_into`, the built-in engine's trainer_writes
    copy); False when the copy declined them (nothing written)."""
    from weightsync.bus.copy.verified_copy import copy_all_into

    if not batch:
        return True
    prepared = model.__dict__.setdefault("_ws_prepared", {})
    pending = copy_all_into([b[1] for b in batch], [b[2] for b in batch], [b[3] for b in batch], prepared=prepared)
    if pending is None:
        log.error("%s: the copy declined the slot tables' destinations; nothing written", LOADER)
        return False
    for (i, *_), p in zip(batch, pending):
        sums[i], rows[i, 4] = p.sums, BY_TABLE
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
    by_src: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in trace.copies:
        by_src.setdefault(src.data_ptr() - base, []).append((dst, src))
    dests, used = [], 0
    for s in plan.slots:
        m = s.meta
        got = by_src.get(s.offset, [])
        if len(got) != 1:
            return Table(plan, None, f"{m.name}: SGLang's loader copied from its start {len(got)} times")
        dst, src = got[0]
        whole = src.numel() * src.element_size() == m.nbytes and src.is_contiguous()
        if not whole or not dst.is_contiguous() or dst.dtype != m.dtype or dst.numel() != src.numel():
            return Table(
                plan,
                None,
                f"{m.name}: SGLang's loader copies {list(src.shape)} {src.dtype} into "
                f"{list(dst.shape)} {dst.dtype}{'' if dst.is_contiguous() else ' (strided)'}, not the whole tensor "
                "into one region",
            )
        dest = dst.detach().view(m.shape)
        if not torch.equal(dest.reshape(-1).view(torch.uint8), bucket[s.offset : s.offset + m.nbytes]):
            return Table(plan, None, f"{m.name}: SGLang's parameter does not hold the bucket's bytes after its loader")
        dests.append(dest)
        used += 1
    if used != len(trace.copies):
        return Table(plan, None, f"SGLang's loader made {len(trace.copies)} copies for {used} tensors")
    return Table(plan, dests)


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
