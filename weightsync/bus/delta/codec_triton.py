"""The delta codec (codec.py) as fused Triton kernels, for buckets on a CUDA GPU: bitmap kind only.

The torch codec on CUDA is launch- and host-read-bound (docs/BENCHMARKS.md has its rate); these
kernels read each buffer once:
- `diff`: one pass over `new` and `base` in blocks of BLOCK words writes the bitmap of changed
  words, each block's changed count and each block's change of the checksum's word sums
  (checksum.word_sums over the bucket's whole 32-bit words: the unchanged ones cancel).
- `encode`: one host read, the total count (the payload's size; the trainer reads it anyway to
  know whether the bucket changed); then per block, from the bitmap alone, its bytes into the
  payload and the changed words compacted at the block's offset (an exclusive cumsum of the counts).
  Not a payload allocated at its bound (the bucket's size) to skip that read: the framed nccl sender
  needs the length on the host to frame it (nccl/framed.py), and each payload in flight would hold
  a bucket's worth of memory.
- `apply_bitmap` (delta.apply_delta read the header: one host read): a popcount per block of the
  payload's bitmap and one host read (its total against the header's entries, and no bit past the
  bucket's end: refused before any write, as the torch path does); then per block the new words
  scattered into the base, their positions (Applied.positions) and, given the base's sums, the
  change of the sums from the 32-bit words that hold a written word (only those are read back).
Traffic: the compare reads 2 bytes per bucket byte; the rest reads the bitmap (1/16 of a bf16
bucket) and the sectors holding changed words.

Kind: always the bitmap, where it is smaller than the bucket (the torch path picks the smaller of
bitmap and gaps; its kind=BITMAP gives these exact bytes). Gaps would need a second scan for the
gaps' widths and fillers. On the wire, at 1 / 2 / 3 % of bf16 words changed, a bitmap costs 7.3 /
8.3 / 9.3 % of the bucket's bytes and one-byte gaps about 1.5 / 3.0 / 4.5 %: ~0.05 GB more per GB
of bucket. The torch encode that gaps take is slow enough (docs/BENCHMARKS.md) that the bitmap at
kernel speed is through sooner on any link but a slow one (a few Gb/s), and a CUDA-resident base
exists only on the nccl path (tcp keeps it in host memory): links from tens of Gb/s up.
bench/bench_delta_gpu_codec.py measures both.
Triton ships with CUDA builds of torch only: codec.py falls back to torch when `available()` is false.
"""

from __future__ import annotations

import functools

import torch

from weightsync.bus.delta import payload as fmt
from weightsync.bus.errors import CorruptFrame
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

#: words per program (512 bitmap bytes) and its warps: the fastest of the configurations that
#: bench_delta_gpu_codec.py --configs times (docs/BENCHMARKS.md), in encode, the trainer's whole pass and
#: apply alike; 2048 words at 16 warps fits in fewer registers but moves half the bytes per program
BLOCK = 4096
WARPS = 8


@functools.lru_cache(maxsize=1)
def _kernels():
    # a module of its own (triton at its top): imported here, lazily, and only where triton is
    from weightsync.bus.delta import kernels_triton as k

    return k.compare, k.compact, k.write_changed, k.popcount, k.scatter


def _run(kernel, blocks: int, device: torch.device, *args, **meta) -> None:
    if device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        kernel[(blocks,)](*args, BLOCK=BLOCK, **meta)
        return
    with torch.cuda.device(device):
        kernel[(blocks,)](*args, BLOCK=BLOCK, num_warps=WARPS, **meta)


def _blocks(nwords: int) -> int:
    return max(1, -(-nwords // BLOCK))


def _offsets(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each block's first entry, the running total whose last element is the count)."""
    cum = counts.cumsum(0)  # int64
    return cum - counts, cum


class FusedDiff:
    """delta.Diff's interface over the bitmap one compare pass wrote (see `diff`)."""

    def __init__(self, new: torch.Tensor, word: int, bitmap: torch.Tensor, counts: torch.Tensor, sums: torch.Tensor):
        self.word, self.new, self.bitmap = word, new, bitmap
        self._offsets, self._cum = _offsets(counts)
        self._sums = sums
        self._count: int | None = None

    def count(self) -> int:
        """Changed words: the one host read (cached)."""
        if self._count is None:
            self._count = int(self._cum[-1])
        return self._count

    def sums_change(self) -> torch.Tensor:
        """How checksum.word_sums of the base changes when it becomes `new` (int64 [sum, sum of squares])."""
        return self._sums.sum(dim=0)

    def write(self, base: torch.Tensor) -> None:
        """Make `base` (the compared base, or a copy) equal to `new` (still unchanged): the changed words only."""
        nw = fmt.words_of(self.new, self.word)
        _run(_kernels()[2], self._offsets.numel(), base.device, nw, self.bitmap, fmt.words_of(base, self.word),
             self.bitmap.numel())  # fmt: skip

    @property
    def idx(self) -> torch.Tensor:
        """Sorted positions of the changed words (unpacked by torch: tests and rare callers)."""
        bits = (self.bitmap.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=self.bitmap.device)) & 1
        return bits.reshape(-1).nonzero().squeeze(1)

    @property
    def values(self) -> torch.Tensor:
        return fmt.words_of(self.new, self.word).index_select(0, self.idx)


def diff(new: torch.Tensor, base: torch.Tensor, word: int) -> FusedDiff:
    """delta.diff's result for flat uint8 `new` and `base` of one size (checked by the caller), in one pass."""
    nwords, dev = new.numel() // word, new.device
    blocks = _blocks(nwords)
    bitmap = torch.empty((nwords + 7) // 8, dtype=torch.uint8, device=dev)
    counts = torch.empty(blocks, dtype=torch.int64, device=dev)
    sums = torch.empty(blocks, 2, dtype=torch.int64, device=dev)
    nw, bw = fmt.words_of(new, word), fmt.words_of(base, word)
    _run(_kernels()[0], blocks, dev, nw, bw, bitmap, counts, sums, nwords, new.numel() // 4, bitmap.numel(), WORD=word)
    return FusedDiff(new, word, bitmap, counts, sums)


def encode(new: torch.Tensor, d: FusedDiff) -> torch.Tensor | None:
    """The bitmap payload of `d` (delta.encode's bytes with kind=BITMAP), or None where it is not
    smaller than `new`."""
    n, word, nbytes = d.count(), d.word, new.numel()
    if n == 0:
        return fmt.empty_payload(word, new.device)
    pos_bytes = d.bitmap.numel()
    if pos_bytes + n * word + fmt.HEADER_BYTES >= nbytes:
        return None
    payload = torch.empty(fmt.HEADER_BYTES + pos_bytes + n * word, dtype=torch.uint8, device=new.device)
    payload[: fmt.HEADER_BYTES].copy_(fmt.header(fmt.BITMAP, word, 0, n))  # the stream idles: count read
    _run(_kernels()[1], d._offsets.numel(), new.device, fmt.words_of(new, word), d.bitmap, d._offsets, payload,
         pos_bytes, HDR=fmt.HEADER_BYTES, WORD=word)  # fmt: skip
    return payload


def apply_bitmap(payload: torch.Tensor, base: torch.Tensor, word: int, entries: int, sums: torch.Tensor | None):
    """delta.apply_delta of a bitmap payload onto `base` on the GPU, its header read and its length
    checked (payload.read_header, check_length)."""
    nwords, dev = base.numel() // word, base.device
    pos_bytes = (nwords + 7) // 8
    bitmap = payload[fmt.HEADER_BYTES :].to(dev)  # then the new words
    blocks = _blocks(nwords)
    kernels = _kernels()
    counts = torch.empty(blocks, dtype=torch.int64, device=dev)
    _run(kernels[3], blocks, dev, bitmap, counts, pos_bytes)
    offsets, cum = _offsets(counts)
    past = (bitmap[pos_bytes - 1 : pos_bytes].to(torch.int64) >> (nwords % 8)) if nwords % 8 else cum[-1:] * 0
    marked, past = torch.cat([cum[-1:], past]).tolist()
    if past:
        raise CorruptFrame("delta bitmap marks positions past the bucket's end")
    if marked != entries:
        raise CorruptFrame(f"delta bitmap marks {marked} positions, header says {entries}")
    positions = torch.empty(entries, dtype=torch.int64, device=dev)
    change = torch.zeros(blocks, 2, dtype=torch.int64, device=dev)
    _run(kernels[4], blocks, dev, bitmap, offsets, fmt.words_of(base, word), positions, change, pos_bytes,
         base.numel() // 4, WORD=word, SUMS=sums is not None)  # fmt: skip
    out = None if sums is None else sums.to(dev) + change.sum(dim=0)
    return fmt.Applied(word, positions, out)
