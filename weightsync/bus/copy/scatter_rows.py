"""The work table of the copy-and-checksum kernel (scatter_triton.py): rows that move 16 bytes per access.

A row read from a table gives Triton no alignment to rely on (a source or destination address loaded
from memory may be any multiple of 4), so it moves one 4-byte word per access: that is why a single
launch over every bucket, with raw addresses in its table, measured slower per byte on GPU than one
launch per bucket (docs/BENCHMARKS.md). Here each row holds word offsets from two base pointers
that the launch passes (16-byte aligned), and a row whose offsets and length are multiples of VEC words
is stored divided by VEC: the kernel multiplies back by the constant, so the compiler knows every
address and the mask are 16-byte aligned. A copy region that starts off that boundary gets a short
head and tail row of single words around an aligned body; one whose source and destination are not
aligned alike stays in single-word rows (correct, slower: no vectorised access can serve both). The
rows cover every word of the regions exactly once, so the sums are those of the whole bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

VEC = 4  # words: 16 bytes per access
SUM = 0  # row kinds: words only summed (the gaps between tensors)
COPY_VEC = 1  # copied and summed, offsets and length in units of VEC words
COPY = 2  # copied and summed, one word per access


def rows_of(
    buckets: Sequence[tuple[int, Sequence[tuple[int, int, int]]]],
    src_base: int,
    dst_base: int,
    row_words: int,
    groups: int = 1,
) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """The table's rows (kind, source offset, destination offset, count) and each row's bucket index.

    `buckets`: per bucket, (byte address of its words, regions as (first word, word count, destination
    byte address or 0 for words only summed[, group])); `src_base` / `dst_base`: the byte addresses the offsets
    are taken from (word offsets; they may be negative); `row_words`: the most words of one row (one
    program's work), a multiple of VEC. `groups`: a row's owner is `bucket * groups + group` (a region's
    fourth field, 0 when absent): sums kept apart within a bucket (a TP rank's shards, shard_copy.py)."""
    if row_words <= 0 or row_words % VEC:
        raise ValueError(f"row_words={row_words} must be a positive multiple of {VEC}")
    if src_base % 4 or dst_base % 4:
        raise ValueError(f"base addresses {src_base:#x}, {dst_base:#x} must be 4-byte aligned")
    bases_aligned = src_base % (4 * VEC) == 0 and dst_base % (4 * VEC) == 0
    rows: list[tuple[int, int, int, int]] = []
    owner: list[int] = []

    def add(kind: int, src: int, dst: int, count: int, b: int) -> None:
        # src / dst: byte addresses; cut into rows of at most row_words words
        unit = VEC if kind == COPY_VEC else 1
        for k in range(0, count, row_words):
            n = min(row_words, count - k)
            s, d = (src - src_base) // 4 + k, (dst - dst_base) // 4 + k if kind != SUM else 0
            rows.append((kind, s // unit, d // unit, n // unit))
            owner.append(b)

    for b, (addr, regions) in enumerate(buckets):
        if addr % 4:
            raise ValueError(f"bucket {b}: its words at {addr:#x} are not 4-byte aligned")
        for region in regions:
            first, count, dst = region[:3]
            if count <= 0:
                continue
            g = b * groups + (region[3] if len(region) > 3 else 0)
            src = addr + 4 * first
            if not dst:
                add(SUM, src, 0, count, g)
                continue
            if dst % 4:
                raise ValueError(f"bucket {b}: destination {dst:#x} is not 4-byte aligned")
            head = (-src % (4 * VEC)) // 4
            if not bases_aligned or (src - dst) % (4 * VEC) or count - head < VEC:
                add(COPY, src, dst, count, g)
                continue
            body = (count - head) // VEC * VEC
            if head:
                add(COPY, src, dst, head, g)
            add(COPY_VEC, src + 4 * head, dst + 4 * head, body, g)
            rest = count - head - body
            if rest:
                add(COPY, src + 4 * (head + body), dst + 4 * (head + body), rest, g)
    return rows, owner
