"""Copy a received bucket out of the bus buffer and checksum it in the same pass.

A rollout used to read every bucket twice: once for its `ws-sum64-v1` checksum, then again to
copy each tensor out (into its staging copy, or into the engine's parameters) before the bus
buffer is reused. Here every word is read once: the copy also accumulates the checksum's word
sums (one fused Triton kernel per tensor on CUDA, checksum.copy_word_sums; copy-then-sum on the
CPU). The sums are order-independent, so the tensors' sums plus those of the alignment gaps
between them give exactly the value `bucket_checksum` gives for the whole buffer.

Nothing here decides what a mismatch means: callers compare the returned checksum with the
sender's, as before, and say what to do with bytes already copied.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.bus.checksum import copy_word_sums, from_sums, word_sums
from weightsync.bus.plan import BucketPlan


@dataclass
class PendingChecksum:
    """A bucket checksum whose copy is still queued on the GPU: read it with `value()`."""
    sums: torch.Tensor
    tail: torch.Tensor
    nbytes: int
    ready: object = None  # a torch.cuda.Event recorded after the copy, or None on the CPU

    def wait(self) -> None:
        """Until the copy (and so every read of the source buffer) has completed."""
        if self.ready is not None:
            self.ready.synchronize()

    def value(self) -> int:
        self.wait()
        return from_sums(self.sums, self.tail, self.nbytes)


def _result(sums: torch.Tensor, buf: torch.Tensor, end: int, n: int, wait: bool):
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


def copy_into(plan: BucketPlan, buf: torch.Tensor, dests: Sequence[torch.Tensor], wait: bool = True):
    """Copy each slot of bucket `plan` from `buf` into `dests` (one per slot, its exact shape and
    dtype) and return the bucket's checksum; None, with nothing copied, when a destination is
    not laid out for it (not contiguous, or not 4-byte aligned): the caller copies another way.
    `wait=False`: return a PendingChecksum at once, without waiting for the GPU (the caller keeps
    `buf` unchanged until it has read the value)."""
    if len(dests) != len(plan.slots):
        raise ValueError(f"bucket {plan.index}: {len(dests)} destinations for {len(plan.slots)} tensors")
    if buf.numel() < plan.nbytes or buf.data_ptr() % 4:
        raise ValueError(f"bucket {plan.index}: a buffer of {buf.numel()} bytes at address {buf.data_ptr():#x} "
                         f"cannot hold its {plan.nbytes} bytes as words")
    device = buf.device
    for slot, d in zip(plan.slots, dests):
        # checked on the tensors themselves, no views: this runs for every tensor of every sync
        if (not d.is_contiguous() or d.data_ptr() % 4 or d.numel() * d.element_size() != slot.meta.nbytes
                or d.device != device):
            return None
    if buf.is_cuda and _fused():
        return _copy_into_cuda(plan, buf, dests, wait)
    views = [_byte_view(d) for d in dests]
    acc = torch.zeros(2, dtype=torch.int64, device=buf.device)
    pos = 0  # bytes of buf before `pos` are summed; always a whole number of words
    for slot, dst in zip(plan.slots, views):
        off, nb = slot.offset, slot.meta.nbytes  # offsets are aligned (plan.ALIGN): whole words
        if off > pos:  # the alignment gap before this tensor counts in the checksum
            acc += word_sums(_words(buf[pos:off]))
        whole = nb - nb % 4
        if whole:
            acc += copy_word_sums(_words(buf[off:off + whole]), _words(dst[:whole]))
        if nb % 4:  # its last bytes start the next gap's first word
            dst[whole:].copy_(buf[off + whole:off + nb])
        pos = off + whole
    n = plan.nbytes
    end = n - n % 4
    if end > pos:
        acc += word_sums(_words(buf[pos:end]))
    return _result(acc, buf, end, n, wait)


def _fused() -> bool:
    from weightsync.bus import checksum_cuda  # lazy: triton comes only with CUDA builds of torch

    return checksum_cuda.available()


_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_TABLES = 1024  # a few layouts' worth of buckets; the parameters' addresses do not move


def _copy_into_cuda(plan: BucketPlan, buf: torch.Tensor, dests: Sequence[torch.Tensor], wait: bool):
    """copy_into in one kernel launch per bucket: a launch from Python costs tens of microseconds,
    which per tensor (hundreds in a bucket) would cost more than the copy saves. The work table
    (regions of the bucket and where each goes) depends only on the layout and the destinations'
    addresses, so it is built once and kept."""
    from weightsync.bus import checksum_cuda

    regions, pos = [], 0
    for slot, dst in zip(plan.slots, dests):
        off, nb = slot.offset, slot.meta.nbytes
        if off > pos:
            regions.append((pos // 4, (off - pos) // 4, 0))
        whole = nb - nb % 4
        if whole:
            regions.append((off // 4, whole // 4, dst.data_ptr()))
        pos = off + whole
    n = plan.nbytes
    end = n - n % 4
    if end > pos:
        regions.append((pos // 4, (end - pos) // 4, 0))
    key = (buf.device.index, *regions)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        table = _TABLES[key] = checksum_cuda.scatter_table(regions, buf.device)
    sums = checksum_cuda.scatter_word_sums(_words(buf[:end]), table)
    for slot, dst in zip(plan.slots, dests):
        nb = slot.meta.nbytes
        if nb % 4:  # the last bytes of a tensor that does not end on a word: summed with the gap after it
            whole = nb - nb % 4
            _byte_view(dst)[whole:].copy_(buf[slot.offset + whole:slot.offset + nb])
    return _result(sums, buf, end, n, wait)


def copy_bucket(plan: BucketPlan, buf: torch.Tensor, wait: bool = True):
    """A copy of the bucket's bytes (a new flat buffer on `buf`'s device) and their checksum (a
    PendingChecksum with `wait=False`, as for copy_into)."""
    n = plan.nbytes
    if buf.numel() < n or buf.data_ptr() % 4:
        raise ValueError(f"bucket {plan.index}: a buffer of {buf.numel()} bytes at address {buf.data_ptr():#x} "
                         f"cannot hold its {n} bytes as words")
    out = torch.empty(n, dtype=torch.uint8, device=buf.device)
    end = n - n % 4
    sums = copy_word_sums(_words(buf[:end]), _words(out[:end])) if end else torch.zeros(2, dtype=torch.int64)
    out[end:].copy_(buf[end:n])
    return out, _result(sums, buf, end, n, wait)
