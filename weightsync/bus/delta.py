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

import torch

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


def _gap_cost(gaps: torch.Tensor, width: int, word: int) -> int:
    """Bytes of the gap encoding at `width`, fillers included."""
    limit = (1 << (8 * width)) - 1
    fillers = int(((gaps - 1) // limit).sum()) if width < 4 else 0
    return (gaps.numel() + fillers) * (width + word)


def changed_words(new: torch.Tensor, base: torch.Tensor, word: int) -> torch.Tensor:
    """Sorted positions of the `word`-byte words in which `new` and `base` differ."""
    return _changed(new, base, _words(new, word), _words(base, word), word)


def _changed(new: torch.Tensor, base: torch.Tensor, nw: torch.Tensor, bw: torch.Tensor, word: int) -> torch.Tensor:
    """Sorted positions of the words that differ. Compared 8 bytes at a time first (a quarter of the
    elements for bf16: the pass over the whole bucket is the cost), then word by word within the
    blocks that differ."""
    if new.numel() % 8 or new.storage_offset() % 8 or base.storage_offset() % 8:
        return (nw != bw).nonzero().squeeze(1)
    n64, b64 = new.view(torch.int64), base.view(torch.int64)
    blocks = (n64 != b64).nonzero().squeeze(1)
    per, bits = 8 // word, 8 * word
    # which words of each differing block differ: the nonzero `bits`-wide fields of their XOR
    # (little-endian: word k of a block is bits [k * bits, (k + 1) * bits))
    x = (n64[blocks] ^ b64[blocks]).unsqueeze(1)
    shifts = torch.arange(0, 64, bits, device=new.device)
    hit = ((x >> shifts) & ((1 << bits) - 1)).ne(0).nonzero()
    return blocks[hit[:, 0]] * per + hit[:, 1]


def encode(new: torch.Tensor, base: torch.Tensor, word: int, idx: torch.Tensor | None = None) -> torch.Tensor | None:
    """The delta from `base` to `new` (flat uint8 buffers of one size) as a uint8 payload on their
    device, or None when it is not smaller than `new`. `idx`: changed_words(new, base, word), if known."""
    nbytes = new.numel()
    if base.numel() != nbytes or nbytes % word:
        raise ValueError(f"delta: new has {nbytes} bytes, base {base.numel()} (word {word})")
    nw, bw = _words(new, word), _words(base, word)
    idx = _changed(new, base, nw, bw, word) if idx is None else idx
    n = idx.numel()
    if n == 0:
        return torch.frombuffer(bytearray(_HDR.pack(GAPS, word, 1, 0, 0)), dtype=torch.uint8).to(new.device)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))  # position = previous + gap, from -1
    bitmap_cost = (nw.numel() + 7) // 8 + n * word
    width, cost = min(((w, _gap_cost(gaps, w, word)) for w in (1, 2, 4)), key=lambda wc: wc[1])
    if min(bitmap_cost, cost) + _HDR.size >= nbytes:
        return None
    if bitmap_cost <= cost:
        mask = torch.zeros(((nw.numel() + 7) // 8) * 8, dtype=torch.uint8, device=new.device)
        mask[idx] = 1
        positions = (mask.view(-1, 8) * _bit_weights(new.device)).sum(1, dtype=torch.uint8)
        kind, entries, values = BITMAP, n, nw[idx]
    else:
        limit = (1 << (8 * width)) - 1
        per_gap = (gaps - 1) // limit + 1  # fillers bridge a gap wider than the width holds
        out = torch.full((int(per_gap.sum()),), limit, dtype=torch.int64, device=new.device)
        last = per_gap.cumsum(0) - 1
        out[last] = gaps - (per_gap - 1) * limit
        pos = out.cumsum(0) - 1
        kind, entries, values = GAPS, out.numel(), nw[pos]
        # two's complement: the low bytes of each gap, read back unsigned
        positions = out.to(_GAP[width]).view(torch.uint8) if width > 1 else out.to(torch.uint8)
    head = torch.frombuffer(bytearray(_HDR.pack(kind, word, width, 0, entries)), dtype=torch.uint8)
    return torch.cat([head.to(new.device), positions.reshape(-1), values.contiguous().view(torch.uint8)])


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
