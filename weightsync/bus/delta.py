"""A bucket as the words that changed since a base copy of it: encode on the trainer, apply on a rollout.

Most bf16 values of a model do not change in an optimizer step (Adam's update falls below bf16's
rounding step), so a bucket is compared with the base as 16-bit words (8-bit where it holds an
FP8 tensor) and only the changed positions and their new words travel. Positions go as a bitmap
(one bit per word) or as gaps between successive positions in 1, 2 or 4 bytes, whichever is
smallest for the bucket; a gap too large for its width is bridged by filler positions that carry
the unchanged word (cheaper than a wider width when such gaps are rare). `encode` returns None
where the delta would not be smaller than the dense bucket: that bucket goes dense.

Payload (little-endian): u8 kind (0 bitmap, 1 gaps) | u8 word bytes | u8 gap bytes | u8 0 |
u32 0 | u64 entries | positions | entries x word bytes of new words.

Everything is batched torch ops on the buffers' device (CPU or GPU). The receiver checks the
RESULT against the sender's checksum of the dense bucket, so a wrong base or a damaged payload
fails the sync; `apply_delta` itself only refuses payloads that would write out of bounds.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import torch

from weightsync.bus.checksum import word_sums
from weightsync.bus.errors import TransportError
from weightsync.bus.plan import BucketPlan

_HDR = struct.Struct("<BBBxIQ")
BITMAP, GAPS = 0, 1
_WORD = {1: torch.uint8, 2: torch.int16}
_GAP = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_BITS = None


def word_bytes(plan: BucketPlan) -> int:
    """2 (bf16/fp16 words), or 1 where the bucket holds a one-byte dtype or an odd size."""
    if plan.nbytes % 2 or any(s.meta.dtype.itemsize == 1 or s.offset % 2 for s in plan.slots):
        return 1
    return 2


def _words(buf: torch.Tensor, word: int) -> torch.Tensor:
    return buf.view(_WORD[word])


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
    and the base's update all read, so none of them passes over the bucket again."""

    word: int
    #: sorted positions of the changed words, and their new words
    idx: torch.Tensor
    values: torch.Tensor
    #: the compared blocks (8 or 4 bytes, or single words where the buffers are not aligned for
    #: wider ones) that differ: their positions, new and old contents
    blocks: torch.Tensor
    new_blocks: torch.Tensor
    old_blocks: torch.Tensor

    def sums_change(self) -> torch.Tensor:
        """How checksum.word_sums of `base` changes when it becomes `new`: int64 [sum, sum of
        squares] over the 32-bit words of the changed blocks (a block's unchanged words cancel)."""
        if self.new_blocks.element_size() < 4:
            raise ValueError("Diff.sums_change needs 4-byte aligned buffers (compared as 32- or 64-bit blocks)")
        return word_sums(self.new_blocks.view(torch.int32)) - word_sums(self.old_blocks.view(torch.int32))

    def write(self, base: torch.Tensor) -> None:
        """Make `base` (the compared base, or a copy of it) equal to `new`: only the changed blocks."""
        base.view(self.new_blocks.dtype).index_put_((self.blocks,), self.new_blocks)


def diff(new: torch.Tensor, base: torch.Tensor, word: int) -> Diff:
    """The words in which flat uint8 `new` and `base` differ. Compared 8 bytes at a time (a quarter
    of the elements for bf16: the pass over the whole bucket is the cost), then word by word within
    the blocks that differ only (~8 % of them at 2 % changed bf16 values)."""
    nbytes = new.numel()
    if base.numel() != nbytes or nbytes % word:
        raise ValueError(f"delta: new has {nbytes} bytes, base {base.numel()} (word {word})")
    size = word
    for b in (8, 4):
        if b > word and not (nbytes % b or new.storage_offset() % b or base.storage_offset() % b):
            size = b
            break
    dt = _BLOCK.get(size, _WORD[word])
    nb, bb = new.view(dt), base.view(dt)
    blocks = _nonzero(torch.ne(nb, bb, out=_scratch_mask(nb.numel(), new.device)))
    new_blocks, old_blocks = nb.index_select(0, blocks), bb.index_select(0, blocks)
    if size == word:
        return Diff(word, blocks, new_blocks, blocks, new_blocks, old_blocks)
    # which words of each differing block differ: the nonzero words of their XOR
    per = size // word  # 2, 4 or 8: shifts and masks, not divisions
    j = _nonzero((new_blocks ^ old_blocks).view(_WORD[word]))
    idx = blocks.index_select(0, j >> (per.bit_length() - 1)).mul_(per).add_(j & (per - 1))
    return Diff(word, idx, new_blocks.view(_WORD[word]).index_select(0, j), blocks, new_blocks, old_blocks)


def changed_words(new: torch.Tensor, base: torch.Tensor, word: int) -> torch.Tensor:
    """Sorted positions of the `word`-byte words in which `new` and `base` differ."""
    return diff(new, base, word).idx


def _fillers(gaps: torch.Tensor, gmax: int, width: int) -> int:
    """Filler positions the gaps need at `width` bytes each (a gap wider than the width holds)."""
    limit = (1 << (8 * width)) - 1
    if width == 4 or gmax <= limit:
        return 0
    return int(((gaps[gaps > limit] - 1) // limit).sum())  # the few wide gaps only: integer division is slow


def encode(new: torch.Tensor, base: torch.Tensor, word: int, d: Diff | torch.Tensor | None = None):
    """The delta from `base` to `new` (flat uint8 buffers of one size) as a uint8 payload on their
    device, or None when it is not smaller than `new`. `d`: diff(new, base, word) (or only its
    positions, changed_words'), if known."""
    nbytes = new.numel()
    if base.numel() != nbytes or nbytes % word:
        raise ValueError(f"delta: new has {nbytes} bytes, base {base.numel()} (word {word})")
    nw = _words(new, word)
    if d is None:
        d = diff(new, base, word)
    idx, values = (d.idx, d.values) if isinstance(d, Diff) else (d, None)
    n, nwords, dev = idx.numel(), nbytes // word, new.device
    if n == 0:
        return torch.frombuffer(bytearray(_HDR.pack(GAPS, word, 1, 0, 0)), dtype=torch.uint8).to(dev)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))  # position = previous + gap, from -1
    gmax = int(gaps.max())  # one host read: the widths' filler counts need a pass only when it is large
    bitmap_cost = (nwords + 7) // 8 + n * word
    width, cost = min(((w, (n + _fillers(gaps, gmax, w)) * (w + word)) for w in (1, 2, 4)), key=lambda wc: wc[1])
    if min(bitmap_cost, cost) + _HDR.size >= nbytes:
        return None
    if bitmap_cost <= cost:
        # positions are distinct, so adding each one's bit into its byte sets it
        bits = torch.zeros((nwords + 7) // 8, dtype=torch.int64, device=dev)
        bits.index_add_(0, idx >> 3, torch.bitwise_left_shift(torch.ones_like(idx), idx & 7))
        kind, entries, positions = BITMAP, n, bits.to(torch.uint8)
    else:
        limit = (1 << (8 * width)) - 1
        out = gaps
        if gmax > limit:  # fillers bridge a gap wider than the width holds: `extra` before each wide one
            wide = (gaps > limit).nonzero().squeeze(1)
            extra = torch.zeros_like(gaps).index_put_((wide,), (gaps.index_select(0, wide) - 1) // limit)
            out = torch.full((n + int(extra.sum()),), limit, dtype=torch.int64, device=dev)
            out[torch.arange(n, device=dev) + extra.cumsum(0)] = gaps - extra * limit
            values = None  # fillers carry their unchanged word: gathered below
            idx = out.cumsum(0) - 1
        kind, entries = GAPS, out.numel()
        # two's complement: the low bytes of each gap, read back unsigned
        positions = out.to(_GAP[width]).view(torch.uint8) if width > 1 else out.to(torch.uint8)
    if values is None:
        values = nw.index_select(0, idx)
    head = torch.frombuffer(bytearray(_HDR.pack(kind, word, width, 0, entries)), dtype=torch.uint8)
    pos_bytes = positions.numel()
    payload = torch.empty(_HDR.size + pos_bytes + entries * word, dtype=torch.uint8, device=dev)
    payload[: _HDR.size].copy_(head)
    payload[_HDR.size : _HDR.size + pos_bytes].copy_(positions.reshape(-1))
    payload[_HDR.size + pos_bytes :].copy_(values.view(torch.uint8))
    return payload


def apply_delta(payload: torch.Tensor, base: torch.Tensor) -> None:
    """Write the delta in `payload` onto `base` (flat uint8, modified in place)."""
    if payload.numel() < _HDR.size:
        raise TransportError(f"delta payload of {payload.numel()} bytes is shorter than its header")
    kind, word, width, _, entries = _HDR.unpack(bytes(payload[: _HDR.size].cpu().numpy()))
    if word not in _WORD or base.numel() % word or (kind == GAPS and width not in _GAP) or kind not in (0, 1):
        raise TransportError(
            f"delta header kind={kind} word={word} gap={width} does not fit a {base.numel()}-byte bucket"
        )
    nwords = base.numel() // word
    body = payload[_HDR.size :].to(base.device)
    pos_bytes = (nwords + 7) // 8 if kind == BITMAP else entries * width
    if body.numel() != pos_bytes + entries * word:
        raise TransportError(
            f"delta payload has {body.numel()} bytes after its header; {entries} entries need "
            f"{pos_bytes + entries * word}"
        )
    # clones: a view as wider words needs an aligned start, which a payload's sections need not have
    raw = body[:pos_bytes].clone()
    values = body[pos_bytes:].clone().view(_WORD[word])
    if kind == BITMAP:
        bits = (raw.unsqueeze(1) & _bit_weights(base.device)).ne(0).reshape(-1)
        if bits[nwords:].any():
            raise TransportError("delta bitmap marks positions past the bucket's end")
        pos = bits[:nwords].nonzero().squeeze(1)
        if pos.numel() != entries:
            raise TransportError(f"delta bitmap marks {pos.numel()} positions, header says {entries}")
    else:
        gaps = raw.view(_GAP[width]).to(torch.int64)
        if width < 8:  # the stored two's complement back to an unsigned gap
            gaps = gaps & ((1 << (8 * width)) - 1)
        pos = gaps.cumsum(0) - 1
        if entries and (int(gaps.min()) < 1 or int(pos[-1]) >= nwords):
            raise TransportError("delta positions fall outside the bucket")
    _words(base, word)[pos] = values
