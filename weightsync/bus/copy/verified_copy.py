"""Copy a received bucket out of the bus buffer and checksum it in the same pass.

Checksumming a bucket (`ws-sum64-v1`) and then copying each tensor out (into its staging copy, or
into the engine's parameters) before the bus buffer is reused would read every word twice. Here
every word is read once: the copy also accumulates the checksum's word
sums (on CUDA one launch of the aligned-row Triton kernel, scatter_triton.py). The sums are
order-independent, so the tensors' sums plus those of the alignment gaps between them give exactly
the value `bucket_checksum` gives for the whole buffer. Without that kernel (the CPU) each
operation costs microseconds whatever its size, so the bucket is summed in one operation and each
tensor copied in one more: two reads of small buckets beat hundreds of per-region sums (measured
on the CPU: a several times shorter commit for a model of a few hundred tensors).

Nothing here decides what a mismatch means: callers compare the returned checksum with the
sender's and say what to do with bytes already copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightsync.bus.copy import scatter_triton
from weightsync.bus.copy.checksum import copy_word_sums, from_many_sums, from_sums, word_sums
from weightsync.bus.plan import BucketPlan


@dataclass
class PendingChecksum:
    """A bucket checksum whose copy is still queued on the GPU: read it with `value()`."""

    sums: torch.Tensor
    tail: torch.Tensor
    nbytes: int
    ready: object = None  # a torch.cuda.Event recorded after the copy, or None on the CPU
    #: the [n, 2] sums of one launch over n buckets, whose row `row` is `sums` (pending_values reads them at once)
    rows: torch.Tensor | None = None
    row: int = -1

    def wait(self) -> None:
        """Until the copy (and so every read of the source buffer) has completed."""
        if self.ready is not None:
            self.ready.synchronize()

    def value(self) -> int:
        self.wait()
        return from_sums(self.sums, self.tail, self.nbytes)


def pending_values(pending: list[PendingChecksum]) -> list[int]:
    """Every pending checksum's value, read from the device at once (one wait per copy, which
    costs nothing once the copies are done, and a single read of all the sums)."""
    for p in pending:
        p.wait()
    rows = _shared_rows(pending)
    sums = rows if rows is not None else [p.sums for p in pending]
    return from_many_sums(sums, [p.tail for p in pending], [p.nbytes for p in pending])


def _shared_rows(pending: list[PendingChecksum]) -> torch.Tensor | None:
    """The one [n, 2] tensor whose rows are, in order, every pending checksum's sums (copy_all_into's
    single launch), or None."""
    base = pending[0].rows if pending else None
    if base is None or tuple(base.shape) != (len(pending), 2):
        return None
    if any(p.rows is not base or p.row != i for i, p in enumerate(pending)):
        return None
    return base


def sums_result(sums: torch.Tensor, buf: torch.Tensor, end: int, n: int, wait: bool, sums_to=None):
    """The checksum of `buf[:n]` from a pass's word `sums` (the words before `end`) and its tail: now
    (`wait`), or as a PendingChecksum to read later without a host synchronisation here. `sums_to`
    gets the sums first (a delta base keeps them)."""
    if sums_to is not None:
        sums_to(sums)
    if wait:
        return from_sums(sums, buf[end:n], n)
    ready = None
    if buf.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(buf.device))
    return PendingChecksum(sums, buf[end:n].clone(), n, ready)


def _words(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.int32)


def _byte_view(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s own bytes as a flat uint8 view, or None when they cannot be written as int32 words."""
    if not t.is_contiguous() or t.data_ptr() % 4:
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def _check_buf(plan: BucketPlan, buf: torch.Tensor) -> None:
    if buf.numel() < plan.nbytes or buf.data_ptr() % 4:
        raise ValueError(
            f"bucket {plan.index}: a buffer of {buf.numel()} bytes at address {buf.data_ptr():#x} "
            f"cannot hold its {plan.nbytes} bytes as words"
        )


def _regions(plan: BucketPlan, dests: Sequence[torch.Tensor | None] = ()) -> list[tuple[int, int, int]]:
    """The bucket's whole words as (first word, word count, slot index or -1 for a gap): each
    tensor's words go to its destination, the alignment gaps between them are only summed. A
    tensor's last bytes that do not fill a word are summed with the gap after it. A slot whose
    destination (in `dests`) is None is left out, neither copied nor summed (`_skipped`)."""
    regions, pos = [], 0  # bytes of the bucket before `pos` are covered; a whole number of words
    for i, slot in enumerate(plan.slots):
        off, nb = slot.offset, slot.meta.nbytes  # offsets are aligned (plan.ALIGN): whole words
        if off > pos:
            regions.append((pos // 4, (off - pos) // 4, -1))
        whole = nb - nb % 4
        if whole and not (i < len(dests) and dests[i] is None):
            regions.append((off // 4, whole // 4, i))
        pos = off + whole
    end = plan.nbytes - plan.nbytes % 4
    if end > pos:
        regions.append((pos // 4, (end - pos) // 4, -1))
    return regions


def copy_into(
    plan: BucketPlan,
    buf: torch.Tensor,
    dests: Sequence[torch.Tensor],
    wait: bool = True,
    sums_to: Callable[[torch.Tensor], None] | None = None,
    kernel=None,
):
    """Copy each slot of bucket `plan` from `buf` into `dests` (one per slot, its exact shape and
    dtype; None: a slot of whole words neither copied nor summed, whose sums the caller has from
    elsewhere, which it adds to the returned ones) and return the bucket's checksum; None, with
    nothing copied, when a destination is not laid out for it (not contiguous, or not 4-byte
    aligned): the caller copies another way.
    `wait=False`: return a PendingChecksum at once, without waiting for the GPU (the caller keeps
    `buf` unchanged until it has read the value). `sums_to`: given the word sums of `buf`'s whole
    words that the copy computed (a rollout's delta base keeps them: rollout_svc/sync/delta_base.py).
    `kernel`: a scatter_triton.Config to run on any device (the benchmark; Triton's interpreter on the CPU)."""
    if len(dests) != len(plan.slots):
        raise ValueError(f"bucket {plan.index}: {len(dests)} destinations for {len(plan.slots)} tensors")
    _check_buf(plan, buf)
    if not _laid_out(plan, buf, dests):
        return None
    return _copy_checked(plan, buf, dests, wait, sums_to, kernel)


def _copy_checked(plan: BucketPlan, buf: torch.Tensor, dests: Sequence[torch.Tensor], wait: bool, sums_to, kernel=None):
    """copy_into's copy, for destinations already checked to be laid out for it. `kernel`: a
    scatter_triton.Config to run whatever the device (the benchmark's variants; Triton's interpreter on
    the CPU); None: the configured kernel on CUDA, torch elsewhere."""
    n = plan.nbytes
    end = n - n % 4
    words = _words(buf[:end])
    if kernel is None and not (buf.is_cuda and _fused()):
        if any(d is None for d in dests):
            sums = torch.zeros(2, dtype=torch.int64, device=buf.device)
            for first, count, _ in _regions(plan, dests):
                sums += word_sums(words[first : first + count])
        else:
            sums = word_sums(words)
        for slot, dst in zip(plan.slots, dests):
            if dst is not None:
                _byte_view(dst).copy_(buf[slot.offset : slot.offset + slot.meta.nbytes])
        return sums_result(sums, buf, end, n, wait, sums_to)
    sums = _scatter_vec([plan], [buf], [dests], kernel or scatter_triton.config())[0]
    _copy_partial_words(plan, buf, dests)
    return sums_result(sums, buf, end, n, wait, sums_to)


def _laid_out(plan: BucketPlan, buf: torch.Tensor, dests: Sequence[torch.Tensor]) -> bool:
    """Whether every destination can take its slot as 32-bit words from `buf`'s device."""
    device = buf.device
    for slot, d in zip(plan.slots, dests):
        if d is None:  # left out (summed elsewhere): only whole words can be
            if slot.meta.nbytes % 4:
                return False
            continue
        # checked on the tensors themselves, no views: this runs for every tensor of every sync
        if (
            not d.is_contiguous()
            or d.data_ptr() % 4
            or d.numel() * d.element_size() != slot.meta.nbytes
            or d.device != device
        ):
            return False
    return True


def _copy_partial_words(plan: BucketPlan, buf: torch.Tensor, dests: Sequence[torch.Tensor]) -> None:
    """The bytes of each tensor past its last whole word (the kernel moves words; their sum is in the
    next gap's)."""
    for slot, dst in zip(plan.slots, dests):
        nb = slot.meta.nbytes
        if nb % 4 and dst is not None:
            whole = nb - nb % 4
            _byte_view(dst)[whole:].copy_(buf[slot.offset + whole : slot.offset + nb])


def copy_all_into(
    plans: Sequence[BucketPlan],
    bufs: Sequence[torch.Tensor],
    dests: Sequence[Sequence[torch.Tensor]],
    kernel=None,
    prepared: dict | None = None,
) -> list[PendingChecksum] | None:
    """`copy_into(plan, buf, dests, wait=False)` of every bucket, queued back to back on the current
    stream with no wait between them, for buffers that stay unchanged until the values are read (the
    actor's own storage: nothing is cloned). None, with nothing copied, when a destination is not laid
    out for it. On CUDA one launch of the aligned-row kernel covers every bucket (scatter_rows.py: its
    offsets count from a base pointer in 16-byte units, so its accesses stay 16 bytes wide, where a table
    of raw addresses gives 4-byte ones and measured slower on GPU). `kernel`: a scatter_triton.Config
    forced (as for copy_into's), else the configured one.
    `prepared`: a dict the caller keeps with `dests` (the same tensors at the same addresses at every call,
    plans of one layout: trainer_writes.Destinations): what was checked and built for a set of buffers is
    kept there, so a later call on the same buffers goes straight to its launch (the per-tensor checks and
    the table's key cost Python time per tensor, with the GPU idle)."""
    if not (len(plans) == len(bufs) == len(dests)):
        raise ValueError(f"{len(plans)} buckets, {len(bufs)} buffers and {len(dests)} destination lists")
    for plan, buf, ds in zip(plans, bufs, dests):
        if len(ds) != len(plan.slots):
            raise ValueError(f"bucket {plan.index}: {len(ds)} destinations for {len(plan.slots)} tensors")
        _check_buf(plan, buf)
    cache = None
    if prepared is not None:
        key = tuple((p.index, p.nbytes, b.data_ptr()) for p, b in zip(plans, bufs))
        cache = prepared.get(key)
    if cache is None:
        if not all(map(_laid_out, plans, bufs, dests)):
            return None
        if prepared is not None:
            if len(prepared) >= 8:  # a few sets of buffers (a re-laid-out actor): not one per sync
                prepared.clear()
            cache = prepared[key] = {}
    if plans and (kernel is not None or (bufs[0].is_cuda and _fused())):
        return _copy_all_one_launch(plans, bufs, dests, kernel or scatter_triton.config(), cache)
    return [_copy_checked(plan, buf, ds, False, None, kernel) for plan, buf, ds in zip(plans, bufs, dests)]


def _copy_all_one_launch(plans, bufs, dests, cfg, cache: dict | None) -> list[PendingChecksum]:
    """copy_all_into's buckets in one launch of the aligned-row kernel (scatter_rows.py: offsets from a
    base pointer in units of 16 bytes, so unlike a table of raw addresses the accesses stay 16 bytes wide).
    `cache`: copy_all_into's per-buffers entry of `prepared`, or None."""
    sums = _scatter_vec(plans, bufs, dests, cfg, cache)
    odd = None if cache is None else cache.get("odd")
    if odd is None:  # (bucket, slot) of the tensors whose last bytes do not fill a word
        odd = [
            (i, j)
            for i, plan in enumerate(plans)
            for j, slot in enumerate(plan.slots)
            if slot.meta.nbytes % 4 and dests[i][j] is not None
        ]
        if cache is not None:
            cache["odd"] = odd
    for i, j in odd:
        slot, dst = plans[i].slots[j], dests[i][j]
        nb = slot.meta.nbytes
        whole = nb - nb % 4
        _byte_view(dst)[whole:].copy_(bufs[i][slot.offset + whole : slot.offset + nb])
    ready = None
    if bufs[0].is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(bufs[0].device))
    out = []
    for i, (plan, buf) in enumerate(zip(plans, bufs)):
        n = plan.nbytes
        tail = buf[n - n % 4 : n].clone() if n % 4 else buf[n:n]  # no allocation for none
        out.append(PendingChecksum(sums[i], tail, n, ready, rows=sums, row=i))
    return out


def _fused() -> bool:
    from weightsync.bus.copy import checksum_triton  # lazy: triton comes only with CUDA builds of torch

    return checksum_triton.available()


def copy_bucket(
    plan: BucketPlan, buf: torch.Tensor, wait: bool = True, sums_to: Callable[[torch.Tensor], None] | None = None
):
    """A copy of the bucket's bytes (a new flat buffer on `buf`'s device) and their checksum (a
    PendingChecksum with `wait=False`, as for copy_into; `sums_to` as there)."""
    _check_buf(plan, buf)
    n = plan.nbytes
    out = torch.empty(n, dtype=torch.uint8, device=buf.device)
    end = n - n % 4
    sums = copy_word_sums(_words(buf[:end]), _words(out[:end])) if end else torch.zeros(2, dtype=torch.int64)
    out[end:].copy_(buf[end:n])
    return out, sums_result(sums, buf, end, n, wait, sums_to)


_VEC_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
_MAX_TABLES = 1024  # a few layouts' worth of buckets; the parameters' addresses do not move


def _scatter_vec(plans, bufs, dests, cfg, cache: dict | None = None) -> torch.Tensor:
    """int64 [buckets, 2]: each bucket's word sums, its tensors copied into `dests`, in one launch of the
    aligned-row kernel (scatter_triton.py). The table depends only on the layout, the buffers' and the
    destinations' addresses and the row size: built once and kept (in `cache` too, a caller's entry for
    these buffers and destinations, which then skips even the key)."""
    from weightsync.bus.copy import scatter_rows

    device = bufs[0].device
    anchor = scatter_triton.anchor(device)
    hit = None if cache is None else cache.get(("table", cfg.row_words))
    if hit is not None:
        table, own = hit
        return _launch_vec(anchor, table, own, len(plans), cfg)
    buckets = []
    for plan, buf, ds in zip(plans, bufs, dests):
        regions = tuple((first, count, ds[i].data_ptr() if i >= 0 else 0) for first, count, i in _regions(plan, ds))
        buckets.append((buf.data_ptr(), regions))
    key = (device.type, device.index, cfg.row_words, *buckets)
    hit = _VEC_TABLES.get(key)
    if hit is None:
        rows, owner = scatter_rows.rows_of(buckets, anchor.data_ptr(), anchor.data_ptr(), cfg.row_words)
        table = torch.tensor(rows or [(0, 0, 0, 0)], dtype=torch.int64).to(device)
        own = torch.tensor(owner or [0], dtype=torch.int64).to(device) if len(plans) > 1 else None
        if len(_VEC_TABLES) >= _MAX_TABLES:
            _VEC_TABLES.clear()
        hit = _VEC_TABLES[key] = (table, own)
    if cache is not None:
        cache[("table", cfg.row_words)] = hit
    table, own = hit
    return _launch_vec(anchor, table, own, len(plans), cfg)


def _launch_vec(anchor: torch.Tensor, table: torch.Tensor, own: torch.Tensor | None, buckets: int, cfg):
    partial = scatter_triton.launch(anchor, anchor, table, cfg)
    if own is None:
        return partial.sum(dim=0, keepdim=True)
    # integer sums: the same value in any order (index_add_'s atomics included)
    return torch.zeros((buckets, 2), dtype=torch.int64, device=anchor.device).index_add_(0, own, partial)
