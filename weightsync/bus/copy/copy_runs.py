"""(destination, source) view pairs, planned once as contiguous runs and copied in a launch or two.

A layout's converted tensors (a QKV split per query group, a vocabulary trim, a cast: strided views
of a parameter written into bucket slots) are the same pairs at every sync. `torch._foreach_copy_`
loops over them one kernel at a time when they are strided or cast (tens of microseconds of host
time each, hundreds of them per model). Every such pair is a few contiguous runs of elements (the
dimensions that are contiguous on both sides, collapsed); on a GPU with Triton the runs of all the
pairs go into one address table per (source dtype, destination dtype, alignment), built here once,
and each sync launches one kernel per table (copy_runs_triton.py). Pairs that are not runs (an
element-wise strided view, a dtype the kernel does not cast) and every pair off the GPU go through
`_foreach_copy_`, which writes the same bits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: a pair cut into more runs than this (a column split of a tall matrix) stays with torch: its
#: table would cost more to build and to read than one strided copy
MAX_RUNS_PER_PAIR = 4096


def contiguous_runs(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(source byte address, destination byte address, elements) of the runs that together copy
    `src` into `dst` (same shape), or None when the innermost dimension is not contiguous on both
    sides or the pair would take more than MAX_RUNS_PER_PAIR runs."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy pair: source shape {tuple(src.shape)} != destination shape {tuple(dst.shape)}")
    if src.numel() == 0:
        return []
    dims = [(n, ss, ds) for n, ss, ds in zip(src.shape, src.stride(), dst.stride()) if n != 1]
    inner = 1
    while dims and dims[-1][1] == inner and dims[-1][2] == inner:
        inner *= dims.pop()[0]
    if inner == 1 and dims:
        return None
    if math.prod(n for n, _, _ in dims) > MAX_RUNS_PER_PAIR:
        return None
    s0, d0, se, de = src.data_ptr(), dst.data_ptr(), src.element_size(), dst.element_size()
    runs = []
    for idx in itertools.product(*(range(n) for n, _, _ in dims)):
        so = sum(i * ss for i, (_, ss, _) in zip(idx, dims))
        do = sum(i * ds for i, (_, _, ds) in zip(idx, dims))
        runs.append((s0 + so * se, d0 + do * de, inner))
    return runs


def _kernel_dtypes(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.dtype, torch.dtype] | None:
    """The dtypes the kernel reads and writes for this pair: integer words of the same size for a
    plain copy (bit for bit), float32 into bfloat16's words for the one cast it rounds itself;
    None: torch copies the pair."""
    if dst.dtype == src.dtype:
        word = _WORDS.get(src.element_size())
        return None if word is None else (word, word)
    if src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
        return torch.float32, torch.int16
    return None


class BatchedCopy:
    """Copies `pairs` (destination, source) at each `run()`; the views and their storage must stay
    where they are between runs (the caller replans when a source moves)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, use_kernel: bool | None = None):
        from weightsync.bus.copy import copy_runs_triton as kernel

        self.pairs = len(pairs)
        # the table holds raw addresses: the views keep their memory allocated (never reused under it)
        self._views = list(pairs)
        self._dsts: list[torch.Tensor] = []
        self._srcs: list[torch.Tensor] = []
        #: (table on the device, source base, destination base, alignment in elements) per launch
        self.launches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        devices = {t.device for pair in pairs for t in pair}
        if use_kernel is None:
            use_kernel = len(devices) == 1 and next(iter(devices)).type == "cuda" and kernel.available()
        if not use_kernel or len(devices) != 1:
            self._fallback_all(pairs)
            return
        device = next(iter(devices))
        bases: dict[tuple[torch.dtype, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        rows: dict[tuple[torch.dtype, torch.dtype, int], list[tuple[int, int, int]]] = {}
        for dst, src in pairs:
            key = _kernel_dtypes(dst, src)
            runs = None if key is None else contiguous_runs(dst, src)
            if runs is None:
                self._dsts.append(dst)
                self._srcs.append(src)
                continue
            if key not in bases:  # fresh allocations: aligned far beyond 16 bytes
                bases[key] = (torch.empty(1, dtype=key[0], device=device), torch.empty(1, dtype=key[1], device=device))
            sb, db = bases[key]
            se, de = sb.element_size(), db.element_size()
            offsets = [(sa - sb.data_ptr(), da - db.data_ptr(), n) for sa, da, n in runs]
            if any(s % se or d % de for s, d, _ in offsets):  # a view not on its dtype's boundary
                self._dsts.append(dst)
                self._srcs.append(src)
                continue
            for s, d, n in offsets:
                s, d = s // se, d // de
                align = kernel.ALIGN if s % kernel.ALIGN == 0 and d % kernel.ALIGN == 0 and n % kernel.ALIGN == 0 else 1
                rows.setdefault((*key, align), []).extend(
                    ((s + k) // align, (d + k) // align, min(kernel.ROW_ELEMS, n - k) // align)
                    for k in range(0, n, kernel.ROW_ELEMS)
                )
        for (sdt, ddt, align), rs in rows.items():
            table = torch.tensor(rs, dtype=torch.int64).to(device)
            sb, db = bases[(sdt, ddt)]
            self.launches.append((table, sb, db, align))
        self.kernel_pairs = self.pairs - len(self._dsts)

    def _fallback_all(self, pairs) -> None:
        for dst, src in pairs:
            self._dsts.append(dst)
            self._srcs.append(src)
        self.kernel_pairs = 0

    @property
    def torch_pairs(self) -> int:
        """Pairs copied by torch (one kernel each) rather than by the table's launches."""
        return len(self._dsts)

    def run(self) -> None:
        from weightsync.bus.copy import copy_runs_triton as kernel

        for table, sb, db, align in self.launches:
            kernel.launch(table, sb, db, align)
        if self._dsts:
            torch._foreach_copy_(self._dsts, self._srcs)
