"""The rollout's side of our loader in SGLang's TP workers (sglang_loader.py): buckets handed over unopened.

A CUDA bucket goes to SGLang as `update_weights_from_tensor(load_format=sglang_loader.LOADER)`: SGLang's
Engine pickles the same entries for every TP rank, and each rank's worker runs `sglang_loader.load`. The
bucket itself travels as a CUDA IPC handle: colocated, the trainer's own handle, forwarded unopened
(`weightsync.bus.ipc.handles.source_handle`: torch refuses to share a storage it imported, which made the
old path copy every bucket into a staging buffer first); a buffer of rollout-svc's own (TCP or NCCL received
into CUDA) is shared as it is. Each rank writes a row per bucket (seq, status, word sums, how) into `result`,
a small tensor of ours on its GPU, before SGLang replies; the sums are those of the words the rank's loader
read from the bucket as it wrote them into SGLang's parameters (once the layout's slot table is learnt), so
the transaction checks the bucket after the write (rollout_svc/sync/apply_inplace.py), as for the built-in
engine's direct write.

Each call costs a round trip through SGLang's tokenizer manager and scheduler (milliseconds, whatever the
bucket's size), so buckets the trainer holds unchanged until the commit (its own parameter storage,
`held_until_commit`) are queued (`queue_bucket_summed`) and all written by one call when the commit first
reads their checksums (`PendingChecksum.wait`), or at `end_apply`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

from rollout_svc.engine import sglang_loader as sl
from weightsync.bus.copy.verified_copy import PendingChecksum
from weightsync.bus.errors import SyncError

log = logging.getLogger(__name__)
_HOW = {
    sl.BY_TABLE: "by the slot table (one copy-and-checksum launch)",
    sl.BY_SGLANG: "by SGLang's loader (the layout has no slot table; the worker's log says why)",
    sl.LEARNED: "by SGLang's loader while learning the slot table",
}


class _Queued(PendingChecksum):
    """A queued bucket's checksum: reading it writes every queued bucket first (one SGLang call)."""

    def __init__(self, owner: SglangDirectMixin):
        super().__init__(torch.zeros(2, dtype=torch.int64), torch.empty(0, dtype=torch.uint8), 0)
        self._owner, self.done = owner, False

    def wait(self) -> None:
        if not self.done:
            try:
                self._owner.flush_queued()
            except RuntimeError as exc:  # the commit aborts the sync on a SyncError
                raise SyncError(f"writing the queued buckets into SGLang failed: {exc}", "INTERNAL") from exc


def _combined(plan, ranks: list[list[int]], seq: int) -> tuple[int, int]:
    """The bucket's word sums from every TP rank's result row (sglang_loader.RESULT_WORDS): the ranks' `common`
    sums must agree (each rank read those words itself: the whole bucket, or all but the slots it shards), and
    their `shard` sums add up to the rest (weightsync/bus/copy/shard_copy.py)."""
    from rollout_svc.engine.sglang_weights import SglangUpdateError

    common, s1, s2 = set(), 0, 0
    for rank, row in enumerate(ranks):
        if row[0] != seq or row[1] != sl.OK:
            raise SglangUpdateError(
                f"bucket {plan.index}: SGLang TP rank {rank} did not load it "
                f"({'no answer' if row[0] != seq else 'failed'}; the scheduler's log names the error)"
            )
        common.add((row[2], row[3]))
        s1, s2 = s1 + row[6], s2 + row[7]
    if len(common) != 1:
        raise SglangUpdateError(f"bucket {plan.index}: SGLang's TP ranks read different bytes ({sorted(common)})")
    c1, c2 = common.pop()
    return _int64(c1 + s1), _int64(c2 + s2)


def _int64(v: int) -> int:
    """`v` wrapped as the int64 the checksum's sums are (they wrap on every device)."""
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


class SglangDirectMixin:
    """Expects `self._sgl`, `self.tp_size`, `self._call`, `self.opts` (SglangOptions: `base_gpu_id`,
    `direct_loader`)."""

    _sgl: Any
    tp_size: int
    _call: Any
    opts: Any
    _direct_seq: int = 0
    #: this sync's bytes per TP rank through our loader, and the bytes of those buckets (begin_apply resets)
    rank_bytes: list[int] | None = None
    _direct_bytes: int = 0
    _direct_rows: list[torch.Tensor] | None = None
    _queued: list | None = None
    #: tests/sglang_exec: CPU buffers (and result rows) stand in for CUDA ones
    direct_cpu: bool = False

    @contextlib.contextmanager
    def timed(self, what: str):
        """Adds the block's wall time to `apply_ms[what]` (this sync's, begin_apply resets it)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add_ms(what, (time.perf_counter() - t0) * 1e3)

    def _add_ms(self, what: str, ms: float) -> None:
        acc = self.__dict__.setdefault("apply_ms", {})
        acc[what] = acc.get(what, 0.0) + ms

    def load_bucket_summed(self, plan, buf: torch.Tensor) -> int | None:
        """Load bucket `plan` (bytes in `buf`) through our loader in SGLang's workers and return the
        checksum of what they read; None (nothing loaded) when this engine cannot take it that way. At
        tp_size > 1 with every rank's shards mapped, rollout-svc writes them itself (sglang_shards.py)."""
        written = self.write_shards(plan, buf)  # type: ignore[attr-defined]
        if written is not None:
            return written.value()
        src = self._direct_source(buf)
        if src is None:
            return None
        item = (plan, src, buf, _Queued(self))
        self._send_direct([item])
        return item[3].value()

    def queue_bucket_summed(self, plan, buf: torch.Tensor) -> PendingChecksum | None:
        """As load_bucket_summed for a bucket whose buffer stays unchanged until the commit: written later, with
        every other queued bucket, by one call; the returned checksum's `wait` writes them. None: not queued.
        Written at once where rollout-svc writes the ranks' shards itself (sglang_shards.py)."""
        written = self.write_shards(plan, buf)  # type: ignore[attr-defined]
        if written is not None:
            return written
        src = self._direct_source(buf)
        if src is None:
            return None
        item = (plan, src, buf, _Queued(self))
        if self._queued is None:
            self._queued = []
        self._queued.append(item)
        return item[3]

    def flush_queued(self) -> None:
        """Write every queued bucket now (one SGLang call)."""
        items, self._queued = self._queued or [], None
        if items:
            self._send_direct(items)

    def drop_queued(self) -> None:
        """Forget the buckets of a sync that ended without them (aborted): they are never written."""
        self._queued = None

    def _direct_source(self, buf: torch.Tensor):
        """What to pickle for the bucket in `buf`, or None (not a CUDA bucket, or the loader is off)."""
        if not getattr(self.opts, "direct_loader", False) or not (buf.is_cuda or self.direct_cpu):
            return None
        from weightsync.bus.ipc.handles import source_handle

        h = source_handle(buf)
        if h is not None:
            from rollout_svc.engine.sglang_weights import _IpcTensor

            return _IpcTensor(h, buf.numel())
        return buf

    def _rows(self, n: int) -> list[torch.Tensor]:
        rows = self._direct_rows
        if rows is None or rows[0].shape[0] < n:
            base = int(self.opts.base_gpu_id)
            # per rank, on the rank's GPU: SGLang moves every entry to the worker's device first
            rows = [
                torch.zeros(max(n, 16), sl.RESULT_WORDS, dtype=torch.int64, device=f"cuda:{base + r}")
                for r in range(self.tp_size)
            ]
            self._direct_rows = rows
        return [r[:n] for r in rows]

    def _send_direct(self, items: list) -> None:
        """One SGLang call for `items` [(plan, what to pickle, the bucket's buffer here, its _Queued)]; fills each
        _Queued with the workers' sums and the bucket's last bytes."""
        from rollout_svc.engine.sglang_weights import _patch_reductions, check_result

        self._direct_seq += 1
        seq = self._direct_seq
        rows = self._rows(len(items))  # not cleared: a row counts only when it carries this call's seq
        _patch_reductions()  # CUDA tensors pickle with the device UUID, as SGLang's workers expect
        peer = self._peer_gpus(items)
        if peer:
            from rollout_svc.engine.sglang_peer import per_rank

            entries = [(sl.header(seq, plan), per_rank(src, peer)) for plan, src, _, _ in items]
        else:
            entries = [(sl.header(seq, plan), src) for plan, src, _, _ in items]
        entries += [(sl.RESULT, r) for r in rows]
        with self.timed(f"calls_{len(items)}"):
            res = self._call(
                self._sgl.update_weights_from_tensor, named_tensors=entries, load_format=sl.LOADER, flush_cache=False
            )
        check_result(res, f"update_weights_from_tensor({sl.LOADER})")
        got = [r.tolist() for r in rows]
        for k, (plan, _, buf, pending) in enumerate(items):
            pending.sums = torch.tensor(_combined(plan, [table[k] for table in got], seq), dtype=torch.int64)
            whole = plan.nbytes - plan.nbytes % 4
            pending.tail = buf[whole : plan.nbytes].cpu()
            pending.nbytes, pending.done = plan.nbytes, True
            how = got[0][k][4]
            self._note_how(plan.index, how)
            if how in (sl.LEARNED, sl.BY_TABLE):  # sglang_export.py exports these layouts' tables
                self.__dict__.setdefault("sync_layouts", {})[plan.index] = sl.layout_key(plan)
            self._count_bytes(plan.nbytes, buf, [table[k][8] for table in got], moved=not peer)
        self._add_ms("worker", got[0][0][5] / 1e6)

    def _peer_gpus(self, items: list) -> list[int]:
        """Each TP rank's GPU when the buckets go to every rank opened on its own GPU (sglang_peer.py), else []."""
        if (
            self.tp_size < 2
            or not getattr(self.opts, "peer_reads", False)
            or not all(b.is_cuda for _, _, b, _ in items)
        ):
            return []
        base = int(self.opts.base_gpu_id)
        return [base + r for r in range(self.tp_size)]

    def _count_bytes(self, nbytes: int, buf: torch.Tensor, read: list[int], moved: bool = True) -> None:
        """Add one bucket's bytes per TP rank: what the rank's loader read, or (`moved`) the whole bucket for a
        rank on another GPU than the bucket's (SGLang's worker moves an entry onto its own GPU before our loader
        runs, unless it was opened there: sglang_peer.py)."""
        counts = self.rank_bytes
        if counts is None or len(counts) != len(read):
            counts, self._direct_bytes = [0] * len(read), 0
            self.rank_bytes = counts
        self._direct_bytes += nbytes
        base = int(getattr(self.opts, "base_gpu_id", 0))
        for rank, n in enumerate(read):
            whole = moved and buf.is_cuda and buf.device.index != base + rank
            counts[rank] += nbytes if whole else n

    def bytes_per_rank(self, sync_bytes: int) -> list[int]:
        """Per TP rank, the bytes of this sync's buckets it read (sglang_loader's rows) or received; a bucket
        not loaded through our loader (SGLang's own paths) counts whole for every rank."""
        if self.rank_bytes is None:
            return [sync_bytes] * self.tp_size
        return [c + max(sync_bytes - self._direct_bytes, 0) for c in self.rank_bytes]

    def _note_how(self, index: int, how: int) -> None:
        hows = self.__dict__.setdefault("direct_how", {})
        if hows.get(index) != how:
            # SGLang's Engine sets the root logger to its own level: warning, so that it shows
            log.warning("bucket %d: written in SGLang's workers %s", index, _HOW.get(how, how))
        hows[index] = how
