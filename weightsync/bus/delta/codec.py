"""A bucket as the words that changed since a base copy of it: encode on the trainer, apply on a rollout.

Most bf16 values of a model do not change in an optimizer step (Adam's update falls below bf16's
rounding step), so a bucket is compared with the base as 16-bit words (8-bit where it holds an
FP8 tensor) and only the changed positions and their new words travel. Positions go as a bitmap
(one bit per word) or as gaps between successive positions in 1, 2 or 4 bytes, whichever is
smallest for the bucket; a gap too large for its width is bridged by filler positions that carry
the unchanged word (cheaper than a wider width when such gaps are rare). `encode` returns None
where the delta would not be smaller than the dense bucket: that bucket goes dense.

The payload's layout: payload.py.

Everything is batched torch ops on the buffers' device (CPU or GPU), except on a CUDA GPU with
Triton: there fused kernels (codec_triton.py) compare, encode and apply, and always encode a bitmap
(where smaller than the bucket; codec_triton.py gives the wire cost and why). The receiver checks the
RESULT against the sender's checksum of the dense bucket, so a wrong base or a damaged payload
fails the sync; `apply_delta` itself only refuses payloads that would write out of bounds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weightsync.bus.copy.checksum import word_sums
from weightsync.bus.delta.payload import (
    BITMAP,
    GAP_DTYPES,
    GAPS,
    HEADER_BYTES,
    WORD_DTYPES,
    Applied,
    check_length,
    empty_payload,
    header,
    read_header,
    words_of,
)
from weightsync.bus.errors import CorruptFrame
from weightsync.bus.plan import BucketPlan

if TYPE_CHECKING:
    from weightsync.bus.delta import codec_triton

_BITS = None


def word_bytes(plan: BucketPlan) -> int:
    """2 (bf16/fp16 words), or 1 where the bucket holds a one-byte dtype or an odd size."""
    if plan.nbytes % 2 or any(s.meta.dtype.itemsize == 1 or s.offset % 2 for s in plan.slots):
        return 1
    return 2


def _fused(buf: torch.Tensor):
    """codec_triton where `buf` is on a CUDA GPU and Triton is there, else None (torch ops)."""
    if buf.device.type != "cuda":
        return None
    from weightsync.bus.delta import codec_triton  # lazy: triton comes only with CUDA builds of torch

    return codec_triton if codec_triton.available() else None


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


_scratch = threading.local()  # per thread (a trainer's senders, tests): the compare's mask


def _scratch_mask(n: int, device: torch.device) -> torch.Tensor:
    """A bool buffer of n elements, reused from bucket to bucket: a fresh one each time costs its
    page faults, about as much as the comparison that fills it."""
    buf = getattr(_scratch, "mask", None)
    if buf is None or buf.numel() < n or buf.device != device:
        buf = _scratch.mask = torch.empty(n, dtype=torch.bool, device=device)
    return buf[:n]


def _nonzero(t: torch.Tensor) -> torch.Tensor:
    """Positions (int64) of the nonzero elements of flat `t`. On the CPU numpy's, ~20 % faster than
    torch's here (the compare's second-largest cost); elsewhere torch's, on the tensor's device."""
    if t.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.flatnonzero(t.numpy()))
    return t.nonzero().squeeze(1)


_BLOCK = {8: torch.int64, 4: torch.int32}


@dataclass
class Diff:
    """Where `new` differs from `base`, from one comparison pass; what encode, the checksum's sums
    and the base's update all read, so none of them passes over the bucket again. In parts, one per
    compared step of the bucket, in order (see `diff`): each part's arrays stay small."""

    word: int
    #: per part: sorted positions of the changed words and their new words; then the compared blocks
    #: (8 or 4 bytes, or single words where the buffers are not aligned for wider ones) that differ:
    #: their positions, new and old contents
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def idx(self) -> torch.Tensor:
        """Sorted positions of all the changed words."""
        return _cat([p[0] for p in self.parts])

    @property
    def values(self) -> torch.Tensor:
        return _cat([p[1] for p in self.parts])

    def count(self) -> int:
        return sum(p[0].numel() for p in self.parts)

    def sums_change(self) -> torch.Tensor:
        """How checksum.word_sums of `base` changes when it becomes `new`: int64 [sum, sum of
        squares] over the 32-bit words of the changed blocks (a block's unchanged words cancel)."""
        if self.parts[0][3].element_size() < 4:
            raise ValueError("Diff.sums_change needs 4-byte aligned buffers (compared as 32- or 64-bit blocks)")
        out = torch.zeros(2, dtype=torch.int64, device=self.parts[0][3].device)
        for _, _, _, nb, ob in self.parts:
            if nb.numel():
                out += word_sums(nb.view(torch.int32)) - word_sums(ob.view(torch.int32))
        return out

    def write(self, base: torch.Tensor) -> None:
        """Make `base` (the compared base, or a copy of it) equal to `new`: only the changed blocks."""
        view = base.view(self.parts[0][3].dtype)
        for _, _, blocks, nb, _ in self.parts:
            view.index_put_((blocks,), nb)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


#: CPU: bytes of bucket compared (and entries encoded or applied) per step, so that every temporary
#: stays small: cache-resident, and reused by the allocator rather than freshly mapped (first-touch
#: page faults of a large bucket's temporaries cost more than the compare itself)
_STEP_BYTES = 16 << 20
_STEP_ENTRIES = 1 << 21


def diff(new: torch.Tensor, base: torch.Tensor, word: int) -> Diff | codec_triton.FusedDiff:
    """The words in which flat uint8 `new` and `base` differ. Compared 8 bytes at a time (a quarter
    of the elements for bf16: the pass over the whole bucket is the cost), then word by word within
    the blocks that differ only (~8 % of them at 2 % changed bf16 values); on the CPU in 16 MiB steps."""
    nbytes = new.numel()
    if base.numel() != nbytes or nbytes % word:
        raise ValueError(f"delta: new has {nbytes} bytes, base {base.numel()} (word {word})")
    fused = _fused(new)
    if fused is not None and base.device == new.device:
        return fused.diff(new, base, word)
    size = word
    for b in (8, 4):
        if b > word and not (nbytes % b or new.storage_offset() % b or base.storage_offset() % b):
            size = b
            break
    dt = _BLOCK.get(size, WORD_DTYPES[word])
    nb, bb = new.view(dt), base.view(dt)
    step = _STEP_BYTES // size if new.device.type == "cpu" else max(nb.numel(), 1)
    return Diff(
        word,
        [_diff_blocks(nb[i : i + step], bb[i : i + step], i, size, word) for i in range(0, max(nb.numel(), 1), step)],
    )


def _diff_blocks(nb: torch.Tensor, bb: torch.Tensor, first: int, size: int, word: int):
    """diff's part for the blocks `nb` vs `bb`, block `first` on: (idx, values, blocks, new, old)."""
    blocks = _nonzero(torch.ne(nb, bb, out=_scratch_mask(nb.numel(), nb.device)))
    new_blocks, old_blocks = nb.index_select(0, blocks), bb.index_select(0, blocks)
    if first:
        blocks += first
    if size == word:
        return blocks, new_blocks, blocks, new_blocks, old_blocks
    # which words of each differing block differ: the nonzero words of their XOR
    per = size // word  # 2, 4 or 8: shifts and masks, not divisions
    j = _nonzero((new_blocks ^ old_blocks).view(WORD_DTYPES[word]))
    idx = blocks.index_select(0, j >> (per.bit_length() - 1)).mul_(per).add_(j & (per - 1))
    return idx, new_blocks.view(WORD_DTYPES[word]).index_select(0, j), blocks, new_blocks, old_blocks


def changed_words(new: torch.Tensor, base: torch.Tensor, word: int) -> torch.Tensor:
    """Sorted positions of the `word`-byte words in which `new` and `base` differ."""
    return diff(new, base, word).idx


def _fillers(gaps: torch.Tensor, gmax: int, width: int) -> int:
    """Filler positions the gaps need at `width` bytes each (a gap wider than the width holds)."""
    limit = (1 << (8 * width)) - 1
    if width == 4 or gmax <= limit:
        return 0
    return int(((gaps[gaps > limit] - 1) // limit).sum())  # the few wide gaps only: integer division is slow


def _with_fillers(gaps: torch.Tensor, idx: torch.Tensor, nw: torch.Tensor, values: torch.Tensor, limit: int):
    """(gaps, words) with filler entries bridging each gap wider than `limit`: `extra` fillers of
    gap `limit` before it, each carrying the unchanged word at its position. Only the few wide gaps'
    fillers are computed and gathered from the bucket (a gather over a large bucket misses the cache)."""
    n, dev = gaps.numel(), gaps.device
    wide = (gaps > limit).nonzero().squeeze(1)
    extra = (gaps.index_select(0, wide) - 1) // limit  # fillers before each wide gap's entry
    total = int(extra.sum())
    shift = torch.zeros_like(gaps).index_put_((wide,), extra).cumsum_(0)  # fillers up to and at each entry
    at = torch.arange(n, device=dev).add_(shift)  # where each entry lands
    out = torch.full((n + total,), limit, dtype=torch.int64, device=dev)
    out[at] = gaps - torch.zeros_like(gaps).index_put_((wide,), extra * limit)
    # the fillers: k = 1..extra after the previous entry's position (-1 before the first)
    group = torch.repeat_interleave(torch.arange(wide.numel(), device=dev), extra)
    k = torch.arange(total, device=dev) - (extra.cumsum(0) - extra).index_select(0, group) + 1
    prev = idx.index_select(0, wide) - gaps.index_select(0, wide)
    fill_pos = prev.index_select(0, group) + k * limit
    fill_at = at.index_select(0, wide).index_select(0, group) - extra.index_select(0, group) + k - 1
    words = torch.empty(n + total, dtype=nw.dtype, device=nw.device)
    words[at] = values
    words[fill_at] = nw.index_select(0, fill_pos)
    return out, words


def encode(new: torch.Tensor, base: torch.Tensor, word: int, d=None, kind: int | None = None):
    """The delta from `base` to `new` (flat uint8 buffers of one size) as a uint8 payload on their
    device, or None when it is not smaller than `new`. `d`: diff(new, base, word) (or only its
    positions, changed_words'), if known. `kind`: None for the smaller of bitmap and gaps, BITMAP
    for the bitmap wherever it is smaller than `new` — what the fused codec on a CUDA GPU always
    emits (codec_triton.py), byte for byte. Encoded part by part into the one payload buffer."""
    nbytes = new.numel()
    if base.numel() != nbytes or nbytes % word:
        raise ValueError(f"delta: new has {nbytes} bytes, base {base.numel()} (word {word})")
    if kind not in (None, BITMAP):
        raise ValueError(f"delta: kind={kind} must be None (the smaller) or BITMAP ({BITMAP})")
    fused = _fused(new)
    if fused is not None and base.device == new.device and (d is None or isinstance(d, fused.FusedDiff)):
        return fused.encode(new, d if d is not None else fused.diff(new, base, word))
    nw = words_of(new, word)
    if d is None:
        d = diff(new, base, word)
    parts = [(p[0], p[1]) for p in d.parts] if isinstance(d, Diff) else [(d, nw.index_select(0, d))]
    parts = [p for p in parts if p[0].numel()]
    n, nwords, dev = sum(p[0].numel() for p in parts), nbytes // word, new.device
    if n == 0:
        return empty_payload(word, dev)
    bitmap_cost = (nwords + 7) // 8 + n * word
    gaps, gmax, fillers, width, cost = [], [], {}, 0, bitmap_cost + 1
    if kind is None:
        prev = -1
        for idx, _ in parts:  # position = previous + gap, from -1
            gaps.append(torch.diff(idx, prepend=idx.new_full((1,), prev)))
            prev = int(idx[-1])
        # one host read per part: the widths' filler counts need a pass only where a gap is large
        gmax = [int(g.max()) for g in gaps]
        fillers = {w: sum(_fillers(g, m, w) for g, m in zip(gaps, gmax)) for w in (1, 2, 4)}
        width, cost = min(((w, (n + fillers[w]) * (w + word)) for w in (1, 2, 4)), key=lambda wc: wc[1])
    if min(bitmap_cost, cost) + HEADER_BYTES >= nbytes:
        return None
    kind, entries = (BITMAP, n) if bitmap_cost <= cost else (GAPS, n + fillers[width])
    pos_bytes = (nwords + 7) // 8 if kind == BITMAP else entries * width
    payload = torch.empty(HEADER_BYTES + pos_bytes + entries * word, dtype=torch.uint8, device=dev)
    payload[:HEADER_BYTES].copy_(header(kind, word, width if kind == GAPS else 0, entries))
    positions, words = payload[HEADER_BYTES : HEADER_BYTES + pos_bytes], payload[HEADER_BYTES + pos_bytes :]
    if kind == BITMAP:
        positions.zero_()
    limit, at_pos, at_val = (1 << (8 * width)) - 1, 0, 0
    for i, (idx, values) in enumerate(parts):
        if kind == BITMAP:
            # positions are distinct, so adding each one's bit into its byte sets it; a part's
            # positions span a few bytes of the bitmap only
            lo, hi = int(idx[0]) >> 3, (int(idx[-1]) >> 3) + 1
            bits = torch.zeros(hi - lo, dtype=torch.int64, device=dev)
            bits.index_add_(0, (idx >> 3) - lo, torch.bitwise_left_shift(torch.ones_like(idx), idx & 7))
            positions[lo:hi] += bits.to(torch.uint8)  # parts end on whole bitmap bytes: no byte is shared
        else:
            g = gaps[i]
            if gmax[i] > limit:
                g, values = _with_fillers(g, idx, nw, values, limit)
            # two's complement: the low bytes of each gap, read back unsigned
            raw = g.to(GAP_DTYPES[width]).view(torch.uint8) if width > 1 else g.to(torch.uint8)
            positions[at_pos : at_pos + raw.numel()].copy_(raw)
            at_pos += raw.numel()
        vb = values.view(torch.uint8)
        words[at_val : at_val + vb.numel()].copy_(vb)
        at_val += vb.numel()
    return payload


def apply_delta(payload: torch.Tensor, base: torch.Tensor, sums: torch.Tensor | None = None) -> Applied:
    """Write the delta in `payload` onto `base` (flat uint8, modified in place): the sorted positions
    of the words written and, given `sums` (checksum.word_sums of `base`'s whole 32-bit words
    before), those of the result, from the words written alone: each step's old and new 32-bit
    words that hold a written word (a word two steps share is counted in both: the changes add up).
    On a CUDA GPU with Triton a bitmap payload goes through the fused kernels (codec_triton.py)."""
    kind, word, width, entries = read_header(payload, base)
    nwords = base.numel() // word
    pos_bytes = check_length(payload, kind, word, width, entries, nwords)
    fused = _fused(base)
    if fused is not None and kind == BITMAP:
        return fused.apply_bitmap(payload, base, word, entries, sums)
    body = payload[HEADER_BYTES:].to(base.device)
    # clones: a view as wider words needs an aligned start, which a payload's sections need not have
    raw = body[:pos_bytes].clone()
    values = body[pos_bytes:].clone().view(WORD_DTYPES[word])
    # checked in full before anything is written; then written step by step (small temporaries)
    steps = _bitmap_steps(raw, nwords, entries, base.device) if kind == BITMAP else _gap_steps(raw, width, nwords)
    words, done, written = words_of(base, word), 0, []
    ints = base[: base.numel() - base.numel() % 4].view(torch.int32) if sums is not None else None
    if sums is not None:
        sums = sums.clone()
    for pos in steps():
        at = _int_words(pos, word, ints.numel()) if ints is not None else None
        if at is not None:
            sums -= word_sums(ints.index_select(0, at))
        words[pos] = values[done : done + pos.numel()]
        if at is not None:
            sums += word_sums(ints.index_select(0, at))
        done += pos.numel()
        written.append(pos)
    empty = torch.empty(0, dtype=torch.int64, device=base.device)
    return Applied(word, _cat(written) if written else empty, sums)


def _int_words(pos: torch.Tensor, word: int, n: int) -> torch.Tensor:
    """The distinct 32-bit words (of the first `n`) that hold the `word`-byte words at sorted `pos`:
    a bucket's last bytes past its whole 32-bit words are not in the sums (checksum.from_sums)."""
    at = pos if word == 4 else torch.unique_consecutive(pos >> (2 if word == 1 else 1))
    if at.numel() and int(at[-1]) >= n:
        at = at[: int(torch.searchsorted(at, n))]
    return at


def _bitmap_steps(raw: torch.Tensor, nwords: int, entries: int, device: torch.device):
    step = _STEP_ENTRIES // 8  # bitmap bytes per step

    def positions(lo: int) -> torch.Tensor:
        bits = (raw[lo : lo + step].unsqueeze(1) & _bit_weights(device)).ne(0).reshape(-1)
        return bits.nonzero().squeeze(1) + lo * 8

    if nwords % 8 and int(raw[-1]) >> (nwords % 8):
        raise CorruptFrame("delta bitmap marks positions past the bucket's end")
    marked = sum(int(positions(lo).numel()) for lo in range(0, raw.numel(), step))
    if marked != entries:
        raise CorruptFrame(f"delta bitmap marks {marked} positions, header says {entries}")
    return lambda: (positions(lo) for lo in range(0, raw.numel(), step))


def _gap_steps(raw: torch.Tensor, width: int, nwords: int):
    stored = raw.view(GAP_DTYPES[width])
    mask = (1 << (8 * width)) - 1

    def gaps(s: int) -> torch.Tensor:
        g = stored[s : s + _STEP_ENTRIES].to(torch.int64)
        return g & mask if width < 8 else g  # the stored two's complement back to an unsigned gap

    total = 0
    for s in range(0, stored.numel(), _STEP_ENTRIES):
        g = gaps(s)
        if int(g.min()) < 1:
            raise CorruptFrame("delta positions fall outside the bucket")
        total += int(g.sum())
    if total > nwords:  # the last position is total - 1
        raise CorruptFrame("delta positions fall outside the bucket")

    def positions():
        last = -1
        for s in range(0, stored.numel(), _STEP_ENTRIES):
            pos = gaps(s).cumsum_(0).add_(last)
            last = int(pos[-1])
            yield pos

    return positions
