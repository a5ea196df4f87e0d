"""The rollout's side of our loader in SGLang's TP workers (sglang_loader.py): one call per bucket, no copy here.

A CUDA bucket goes to SGLang as `update_weights_from_tensor(load_format=sglang_loader.LOADER)`: SGLang's
Engine pickles the same entries for every TP rank, and each rank's worker runs `sglang_loader.load`. The
bucket itself travels as a CUDA IPC handle: colocated, the trainer's own handle, forwarded unopened
(`weightsync.bus.ipc.handles.source_handle`: torch refuses to share a storage it imported, which made the
old path copy every bucket into a staging buffer first); a buffer of rollout-svc's own (TCP or NCCL received
into CUDA) is shared as it is. Each rank writes (seq, status, checksum, how) into its row of `result`, a small
tensor of ours on its GPU, before SGLang replies; the checksum is that of the words the rank's loader read
from the bucket (as it wrote them into SGLang's parameters, once the layout's slot table is learnt), so the
transaction checks the bucket after the write (rollout_svc/sync/apply_inplace.py), as for the built-in
engine's direct write.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rollout_svc.engine import sglang_loader as sl

log = logging.getLogger(__name__)
_HOW = {
    sl.BY_TABLE: "by the slot table (one copy-and-checksum launch)",
    sl.BY_SGLANG: "by SGLang's loader (the layout has no slot table; the worker's log says why)",
    sl.LEARNED: "by SGLang's loader while learning the slot table",
}


class SglangDirectMixin:
    """Expects `self._sgl`, `self.tp_size`, `self._call`, `self.opts` (SglangOptions: `base_gpu_id`,
    `direct_loader`) and SglangWeightsMixin's `_IpcTensor` / `check_result` helpers."""

    _sgl: Any
    tp_size: int
    _call: Any
    opts: Any
    _direct_seq: int = 0
    _direct_rows: list[torch.Tensor] | None = None
    #: per bucket index: how the last sync wrote it (sglang_loader.BY_TABLE, BY_SGLANG, LEARNED)
    direct_how: dict[int, int]

    def load_bucket_summed(self, plan, buf: torch.Tensor) -> int | None:
        """Load bucket `plan` (bytes in `buf`) through our loader in SGLang's workers and return the
        checksum of what they read; None (nothing loaded) when this engine cannot take it that way."""
        src = self._direct_source(buf)
        if src is None:
            return None
        return self._send_direct(plan, src)

    def _direct_source(self, buf: torch.Tensor):
        """What to pickle for the bucket in `buf`, or None (not a CUDA bucket, or the loader is off)."""
        if not getattr(self.opts, "direct_loader", False) or not buf.is_cuda:
            return None
        from weightsync.bus.ipc.handles import source_handle

        h = source_handle(buf)
        if h is not None:
            from rollout_svc.engine.sglang_weights import _IpcTensor

            return _IpcTensor(h, buf.numel())
        return buf

    def _rows(self) -> list[torch.Tensor]:
        rows = self._direct_rows
        if rows is None:
            base = int(self.opts.base_gpu_id)
            # one row per rank, on the rank's GPU: SGLang moves every entry to the worker's device first
            rows = [
                torch.zeros(sl.RESULT_WORDS, dtype=torch.int64, device=f"cuda:{base + r}") for r in range(self.tp_size)
            ]
            self._direct_rows = rows
        return rows

    def _send_direct(self, plan, src) -> int:
        from rollout_svc.engine.sglang_weights import SglangUpdateError, _patch_reductions, check_result

        self._direct_seq += 1
        seq = self._direct_seq
        rows = self._rows()  # not cleared: a row counts only when it carries this call's seq
        _patch_reductions()  # CUDA tensors pickle with the device UUID, as SGLang's workers expect
        entries = [(sl.header(seq, plan), src), *((sl.RESULT, r) for r in rows)]
        res = self._call(
            self._sgl.update_weights_from_tensor, named_tensors=entries, load_format=sl.LOADER, flush_cache=False
        )
        check_result(res, f"update_weights_from_tensor({sl.LOADER})")
        got = [r.tolist() for r in rows]
        sums = set()
        for rank, (s, status, checksum, how) in enumerate(got):
            if s != seq or status != sl.OK:
                raise SglangUpdateError(
                    f"bucket {plan.index}: SGLang TP rank {rank} did not load it "
                    f"({'no answer' if s != seq else 'failed'}; the scheduler's log names the error)"
                )
            sums.add(sl.unsigned(checksum))
            hows = self.__dict__.setdefault("direct_how", {})
            if hows.get(plan.index) != how:
                log.info("bucket %d: written in SGLang's workers %s", plan.index, _HOW.get(how, how))
            hows[plan.index] = how
        if len(sums) != 1:
            raise SglangUpdateError(f"bucket {plan.index}: SGLang's TP ranks read different bytes ({sorted(sums)})")
        return sums.pop()
