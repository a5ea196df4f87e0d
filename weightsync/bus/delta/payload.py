"""A delta payload's layout (see codec.py), shared by the torch codec and the fused CUDA one (codec_triton.py).

Payload (little-endian): u8 kind (0 bitmap, 1 gaps) | u8 word bytes | u8 gap bytes (0 for a
bitmap; decoders ignore it there) | u8 0 | u32 0 | u64 entries | positions | entries x word bytes
of new words. A bitmap holds one bit per word, least significant bit first; gaps are unsigned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from weightsync.bus.errors import CorruptFrame

_HDR = struct.Struct("<BBBxIQ")
HEADER_BYTES = _HDR.size
BITMAP, GAPS = 0, 1
WORD_DTYPES = {1: torch.uint8, 2: torch.int16}
GAP_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def words_of(buf: torch.Tensor, word: int) -> torch.Tensor:
    """Flat uint8 `buf` as its `word`-byte words."""
    return buf.view(WORD_DTYPES[word])


def header(kind: int, word: int, width: int, entries: int) -> torch.Tensor:
    """A payload's header bytes (uint8, on the CPU)."""
    return torch.frombuffer(bytearray(_HDR.pack(kind, word, width, 0, entries)), dtype=torch.uint8)


def empty_payload(word: int, device: torch.device) -> torch.Tensor:
    """The payload of a bucket with no changed word: a header of no entries."""
    return header(GAPS, word, 1, 0).to(device)


def read_header(payload: torch.Tensor, base: torch.Tensor) -> tuple[int, int, int, int]:
    """(kind, word bytes, gap bytes, entries) of `payload`, refused where they cannot fit `base`."""
    if payload.numel() < HEADER_BYTES:
        raise CorruptFrame(f"delta payload of {payload.numel()} bytes is shorter than its header")
    kind, word, width, _, entries = _HDR.unpack(bytes(payload[:HEADER_BYTES].cpu().numpy()))
    if (
        word not in WORD_DTYPES
        or base.numel() % word
        or (kind == GAPS and width not in GAP_DTYPES)
        or kind not in (0, 1)
    ):
        raise CorruptFrame(
            f"delta header kind={kind} word={word} gap={width} does not fit a {base.numel()}-byte bucket"
        )
    return kind, word, width, entries


def framed_size(head: bytes, nbytes: int) -> int:
    """The whole size a payload whose first HEADER_BYTES are `head` has, for a bucket of `nbytes`:
    the receiver checks the frame's length field against it before reading on, so a damaged length
    or header is found at once, as corruption, not read as a stream that stopped short."""
    kind, word, width, _, entries = _HDR.unpack(head)
    if word not in WORD_DTYPES or nbytes % word or (kind == GAPS and width not in GAP_DTYPES) or kind not in (0, 1):
        raise CorruptFrame(f"delta header kind={kind} word={word} gap={width} does not fit a {nbytes}-byte bucket")
    nwords = nbytes // word
    if entries > nwords:
        raise CorruptFrame(f"delta header says {entries} entries for a bucket of {nwords} words")
    return HEADER_BYTES + ((nwords + 7) // 8 if kind == BITMAP else entries * width) + entries * word


def check_length(payload: torch.Tensor, kind: int, word: int, width: int, entries: int, nwords: int) -> int:
    """The positions' bytes of a payload with this header; refused unless its length is theirs plus the words'."""
    pos_bytes = (nwords + 7) // 8 if kind == BITMAP else entries * width
    body = payload.numel() - HEADER_BYTES
    if body != pos_bytes + entries * word:
        raise CorruptFrame(
            f"delta payload has {body} bytes after its header; {entries} entries need {pos_bytes + entries * word}"
        )
    return pos_bytes


@dataclass
class Applied:
    """What apply_delta wrote: the written words' sorted positions (`word` bytes each) and, if it
    was given the base's word sums, the result's."""

    word: int
    positions: torch.Tensor
    sums: torch.Tensor | None
