"""A received block-FP8 bucket dequantized straight into an engine's parameters, checksummed in the same launch.

The per-tensor path (receive.Dequantizer, then the engine's `load_weights`) dequantizes each
weight into a new tensor and copies that into its parameter: per weight two launches, a temporary
and two more passes over its bytes, plus a checksum pass of the bucket. Here, for an engine that
offers its parameters (`writable_params`) in bfloat16 or float32, one Triton launch per bucket
(dequantize_slots_triton.py) reads each received word once: it sums every word for the bucket's
`ws-sum64-v1` checksum, copies the 16-bit tensors into their parameters, and writes every FP8
weight's dequantized values into its parameter (the values fp8.dequantize gives, rounded once).
A scale that arrives in the bucket before its weight (the exporter sends `X_scale_inv` first) is
copied by that bucket's launch into a buffer kept per layout, where the next bucket's launch reads it.

Tables depend only on the layout and on the parameters' and held scales' addresses, so they are
built once and kept. Without the kernel (no triton, or off the GPU) the same plan runs in torch,
tensor by tensor, and gives the same bytes and the same checksum. `copy` says None (nothing
written) for a bucket it cannot take (a parameter not laid out for it, a dtype the kernel does not
write, a weight whose scale is neither in its bucket nor held): the caller loads that bucket the
per-tensor way, adding `held_for(plan)` (scales this path kept for its weights) to what it loads.

What a caller does with the checksum (verify before or after the write) is its own contract:
rollout_svc/sync/apply_inplace.py and apply_staged.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightsync.bus.copy.checksum import word_sums
from weightsync.bus.copy.verified_copy import sums_result
from weightsync.bus.plan import BucketPlan, Manifest
from weightsync.formats.fp8.blocks import dequantize_torch, scale_shape, weight_name
from weightsync.formats.fp8.spec import FP8_DTYPE, SCALE_DTYPE

#: parameter dtypes the kernel writes (others: the per-tensor path)
OUT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class _Plan:
    """One bucket's work: kernel tables (or None off the kernel) and the same work for torch."""

    tables: tuple | None
    #: torch path / bookkeeping: (slot index, what: "sum" | "copy" | "hold" | "fp8", destination, scale source)
    steps: list
    #: (destination bytes, first byte in the bucket, count): tensors' last bytes that are not a whole word
    tails: list


class FusedDequant:
    """One engine's fused FP8 loads, kept across syncs (tables and held scales per layout)."""

    def __init__(self, use_kernel: bool | None = None):
        self._use_kernel = use_kernel
        self._digest = ""
        self._held: dict[str, torch.Tensor] = {}  # weight name -> its scale, for a weight in a later bucket
        self._plans: dict[tuple, _Plan] = {}
        self._bases: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    # ---- per sync -------------------------------------------------------------------------
    def begin(self, manifest: Manifest) -> set[str]:
        """A sync of `manifest` starts: the held scales of another layout are dropped. Returns the
        per-sync set of weight names whose scale this path holds (the caller keeps it with the sync)."""
        if manifest.layout_digest != self._digest or not manifest.layout_digest:
            self._digest = manifest.layout_digest
            self._held.clear()
            self._plans.clear()
        return set()

    def held_for(self, plan: BucketPlan, held_now: set[str]) -> list[tuple[str, torch.Tensor]]:
        """(scale name, scale) of this bucket's FP8 weights whose scales this path holds this sync:
        what a per-tensor load of the bucket needs besides the bucket."""
        out = []
        for slot in plan.slots:
            if slot.meta.dtype == FP8_DTYPE and slot.meta.name in held_now:
                out.append((slot.meta.name + "_scale_inv", self._held[slot.meta.name]))
        return out

    def copy(
        self,
        plan: BucketPlan,
        buf: torch.Tensor,
        params: Sequence[torch.Tensor | None],
        held_now: set[str],
        wait: bool = True,
        sums_to: Callable[[torch.Tensor], None] | None = None,
    ):
        """Write bucket `plan` from `buf` into `params` (one per slot: the engine's parameter, None
        for a scale) and return its checksum (a PendingChecksum with `wait=False`); None, with
        nothing written, when the bucket cannot go this way. `sums_to`: given the word sums of the
        bucket's whole words (a rollout's delta base keeps them, as with verified_copy.copy_into)."""
        if len(params) != len(plan.slots) or buf.numel() < plan.nbytes or buf.data_ptr() % 4:
            return None
        p = self._plan(plan, buf.device, params, held_now)
        if p is None:
            return None
        if p.tables is not None:
            from weightsync.formats.fp8 import dequantize_slots_triton as kernel

            sums = kernel.launch(buf, self._base(buf.device), *p.tables)
        else:
            sums = self._run_torch(plan, buf, p)
        for dst, start, count in p.tails:
            dst.copy_(buf[start : start + count])
        for i, what, _, _ in p.steps:
            if what == "hold":
                held_now.add(weight_name(plan.slots[i].meta.name))
        n = plan.nbytes
        return sums_result(sums, buf, n - n % 4, n, wait, sums_to)

    # ---- planning ---------------------------------------------------------------------------
    def _base(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._bases:  # fresh allocations: aligned far beyond any element size
            self._bases[device] = tuple(
                torch.empty(1, dtype=d, device=device) for d in (torch.int32, torch.int16, torch.float32)
            )
        return self._bases[device]

    def _kernel_on(self, device: torch.device) -> bool:
        if self._use_kernel is not None:
            return self._use_kernel
        from weightsync.formats.fp8 import dequantize_slots_triton

        return device.type == "cuda" and dequantize_slots_triton.available()

    def _plan(self, plan: BucketPlan, device, params, held_now: set[str]) -> _Plan | None:
        names = {s.meta.name for s in plan.slots}
        # a weight whose scale came earlier: held this sync (else the per-tensor path holds it)
        need = tuple(
            s.meta.name for s in plan.slots if s.meta.dtype == FP8_DTYPE and s.meta.name + "_scale_inv" not in names
        )
        if any(n not in held_now for n in need):
            return None
        key = (plan.index, str(device), tuple(0 if t is None else t.data_ptr() for t in params))
        if key in self._plans:
            return self._plans[key]
        built = self._build(plan, device, params)
        if built is not None:
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = built
        return built

    def _hold(self, weight: str, shape, device) -> torch.Tensor:
        t = self._held.get(weight)
        if t is None or tuple(t.shape) != tuple(shape) or t.device != device:
            t = self._held[weight] = torch.empty(shape, dtype=SCALE_DTYPE, device=device)
        return t

    def _build(self, plan: BucketPlan, device, params) -> _Plan | None:
        kernel = self._kernel_on(device)
        by_name = {s.meta.name: (i, s) for i, s in enumerate(plan.slots)}
        steps, tails = [], []
        for i, (slot, dst) in enumerate(zip(plan.slots, params)):
            m = slot.meta
            w = weight_name(m.name)
            if w is not None and m.dtype == SCALE_DTYPE and dst is None:
                if w in by_name:
                    steps.append((i, "sum", None, None))
                else:  # its weight comes in a later bucket
                    steps.append((i, "hold", self._hold(w, m.shape, device), None))
                continue
            if dst is None or not dst.is_contiguous() or dst.device != device or tuple(dst.shape) != m.shape:
                return None
            if m.dtype == FP8_DTYPE:
                if (kernel and dst.dtype not in OUT_DTYPES) or not dst.dtype.is_floating_point:
                    return None
                scale = by_name.get(m.name + "_scale_inv")
                src = ("bucket", scale[1]) if scale is not None else ("held", self._held.get(m.name))
                if src[1] is None or (scale is None and tuple(src[1].shape) != scale_shape(m.shape)):
                    return None
                steps.append((i, "fp8", dst, src))
            else:
                if dst.dtype != m.dtype or dst.data_ptr() % 4:
                    return None
                steps.append((i, "copy", dst, None))
                if m.nbytes % 4:
                    whole = m.nbytes - m.nbytes % 4
                    tails.append((dst.reshape(-1).view(torch.uint8)[whole:], slot.offset + whole, m.nbytes % 4))
        tables = self._tables(plan, device, steps) if kernel else None
        if kernel and tables is None:
            return None
        return _Plan(tables, steps, tails)

    def _tables(self, plan: BucketPlan, device, steps) -> tuple | None:
        from weightsync.formats.fp8 import dequantize_slots_triton as k

        word_base, bf16_base, f32_base = self._base(device)
        words: list[tuple[int, int, int, int]] = []
        tensors: list[tuple[int, ...]] = []
        owners: list[int] = []

        def region(first: int, count: int, dst_word: int | None) -> None:
            for j in range(0, count, k.WORDS_PER_ROW):
                n = min(k.WORDS_PER_ROW, count - j)
                dst = 0 if dst_word is None else dst_word + j
                wide = all(v % k.MAX_WV == 0 for v in (first + j, n, dst))
                words.append((first + j, n, dst, dst_word is not None, int(wide)))

        def offset(t: torch.Tensor, base: torch.Tensor) -> int | None:
            delta = t.data_ptr() - base.data_ptr()
            return None if delta % base.element_size() else delta // base.element_size()

        pos = 0  # bucket bytes before `pos` are covered (a whole number of words)
        for i, what, dst, src in steps:
            slot = plan.slots[i]
            off, nb = slot.offset, slot.meta.nbytes
            if off > pos:
                region(pos // 4, (off - pos) // 4, None)
            whole = nb - nb % 4
            if what == "fp8":
                rows_cols = slot.meta.shape
                *lead, rows, cols = rows_cols
                sums_here = cols % 4 == 0
                if not sums_here and whole:
                    region(off // 4, whole // 4, None)
                out_f32 = dst.dtype == torch.float32
                d0 = offset(dst, f32_base if out_f32 else bf16_base)
                if src[0] == "bucket":
                    s0, s_here = src[1].offset // 4, 1
                else:
                    s0, s_here = offset(src[1], f32_base), 0
                if d0 is None or s0 is None:
                    return None
                nrb, ncb = -(-rows // 128), -(-cols // 128)
                tiles = -(-rows // k.TILE_ROWS) * ncb  # block programs of one matrix
                for mtx in range(math.prod(lead)):
                    if rows * cols == 0:
                        continue
                    tensors.append(
                        (
                            rows,
                            cols,
                            off + mtx * rows * cols,
                            s_here,
                            s0 + mtx * nrb * ncb,
                            d0 + mtx * rows * cols,
                            len(owners),
                            int(out_f32),
                            int(sums_here),
                        )
                    )
                    owners.extend([len(tensors) - 1] * tiles)
            elif what in ("copy", "hold"):
                if whole:
                    dw = offset(dst, word_base)
                    if dw is None:
                        return None
                    region(off // 4, whole // 4, dw)
            elif whole:
                region(off // 4, whole // 4, None)
            pos = off + whole
        end = plan.nbytes - plan.nbytes % 4
        if end > pos:
            region(pos // 4, (end - pos) // 4, None)
        # the widest access every FP8 weight of the bucket allows (one with odd columns narrows it)
        vec = k.widest(k.MAX_VEC, (v for t in tensors for v in (t[1], t[2], t[5])))
        return (
            torch.tensor(words or [(0,) * k.WORD_FIELDS], dtype=torch.int64).reshape(-1, k.WORD_FIELDS).to(device),
            torch.tensor(tensors or [(0,) * k.TENSOR_FIELDS], dtype=torch.int64)
            .reshape(-1, k.TENSOR_FIELDS)
            .to(device),
            torch.tensor(owners, dtype=torch.int32).to(device),
            vec,
        )

    def _run_torch(self, plan: BucketPlan, buf: torch.Tensor, p: _Plan) -> torch.Tensor:
        """The reference: the bucket's word sums, then each tensor copied or dequantized by torch."""
        n = plan.nbytes
        sums = word_sums(buf[: n - n % 4].view(torch.int32))
        for i, what, dst, src in p.steps:
            slot = plan.slots[i]
            m = slot.meta
            raw = buf[slot.offset : slot.offset + m.nbytes]
            if what == "hold":
                dst.copy_(raw.view(SCALE_DTYPE).view(m.shape))
            elif what == "copy":
                dst.reshape(-1).view(torch.uint8).copy_(raw)
            elif what == "fp8":
                if src[0] == "bucket":
                    s = (
                        buf[src[1].offset : src[1].offset + src[1].meta.nbytes]
                        .view(SCALE_DTYPE)
                        .view(src[1].meta.shape)
                    )
                else:
                    s = src[1]
                dst.copy_(dequantize_torch(raw.view(FP8_DTYPE).view(m.shape), s, dst.dtype))
        return sums
