"""Word sums of a buffer's words outside some byte ranges: the rest of a bucket's checksum when the
kernel that wrote those ranges summed their words as it wrote them.

The trainer's block-FP8 quantizer (weightsync/formats/fp8/quantize_slots.py) sums the e4m3 and scale words it
writes into a bucket; the bucket's `ws-sum64-v1` checksum then needs only the words of its other
bytes (its 16-bit tensors and the alignment gaps), which checksum.region_word_sums reads: on a GPU
one launch per buffer over a table of those regions cut into program-sized rows (`region_table`,
checksum_triton.scatter_word_sums), built once per layout, since the in-place buckets keep their
addresses from sync to sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KnownSums:
    """Word sums a caller already has: `sums` (int64 [buffers, 2], on the buffers' device, queued on
    the caller's stream) covers, for buffer i, the words of the byte ranges `ranges[i]` ([start, end),
    multiples of 4, sorted, disjoint, inside the buffer's whole words)."""

    sums: torch.Tensor
    ranges: list[list[tuple[int, int]]]


def others(ranges: list[tuple[int, int]], whole: int, name: str = "buffer") -> list[tuple[int, int]]:
    """The byte ranges of [0, whole) outside `ranges`; ValueError (naming `name`) for ranges that are
    not sorted, disjoint, word-aligned and inside it."""
    out, pos = [], 0
    for start, end in ranges:
        if start % 4 or end % 4 or start < pos or end < start or end > whole:
            raise ValueError(
                f"{name}: known range [{start}, {end}) is not word-aligned, sorted, disjoint and inside its "
                f"{whole} bytes of whole words"
            )
        if start > pos:
            out.append((pos, start))
        pos = end
    if whole > pos:
        out.append((pos, whole))
    return out


#: (device, address, regions) -> scatter table: built once per layout (the buckets stay put)
_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_TABLES = 64


def region_table(buf: torch.Tensor, regions: list[tuple[int, int]]) -> torch.Tensor | None:
    """The GPU work table of checksum.region_word_sums(buf, regions) (cached: call it outside a side
    stream, as it may copy to the GPU), or None where the sums are torch's (no triton, off the GPU)."""
    from weightsync.bus.copy import checksum_triton

    regions = [(s, e) for s, e in regions if e > s]
    if not regions or not buf.is_cuda or not checksum_triton.available() or buf.data_ptr() % 4:
        return None
    key = (buf.device, buf.data_ptr(), tuple(regions))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        rows = [(s // 4, (e - s) // 4, 0) for s, e in regions]
        table = _TABLES[key] = checksum_triton.scatter_table(rows, buf.device)
    return table
