"""copy/checksum_regions.py: a bucket's checksum from sums a writer already has of some byte ranges plus a
read of the rest equals `bucket_checksum`; ranges that cannot be words of the buffer are refused by
name (the GPU path: tests/unit/trainer_svc/actor/megatron/test_flat_export.py's FP8 cases on a GPU,
and bench/bench_fp8_slots.py)."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum, region_word_sums, word_sums
from weightsync.bus.copy.checksum_regions import KnownSums, others


def _known(bufs, ranges) -> KnownSums:
    sums = torch.stack(
        [
            sum((word_sums(b[s:e].view(torch.int32)) for s, e in r), torch.zeros(2, dtype=torch.int64))
            for b, r in zip(bufs, ranges)
        ]
    )
    return KnownSums(sums, ranges)


def test_known_sums_plus_the_rest_are_the_bucket_checksums():
    g = torch.Generator().manual_seed(3)
    bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1030, 4096, 258)]
    ranges = [[(0, 256), (512, 1024)], [], [(0, 256)]]  # a range at the start, none, the whole words
    assert InFlightChecksums(bufs, _known(bufs, ranges)).values() == [bucket_checksum(b) for b in bufs]
    # sums that are not those of the ranges give other checksums: the ranges are not read again
    wrong = _known(bufs, ranges)
    wrong.sums[0, 0] += 1
    assert InFlightChecksums(bufs, wrong).value(0) != bucket_checksum(bufs[0])


def test_the_rest_is_read_in_word_ranges():
    assert others([(256, 512), (768, 1024)], 1024) == [(0, 256), (512, 768)]
    assert others([], 8) == [(0, 8)] and others([(0, 8)], 8) == []
    buf = torch.arange(64, dtype=torch.uint8)
    got = region_word_sums(buf, [(0, 8), (8, 8), (32, 64)])
    want = word_sums(buf[:8].view(torch.int32)) + word_sums(buf[32:].view(torch.int32))
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [[(2, 8)], [(8, 16), (4, 12)], [(0, 12)], [(8, 4)]])
def test_ranges_that_are_not_words_of_the_buffer_are_refused(bad):
    with pytest.raises(ValueError, match="bucket 3: known range"):
        others(bad, 8, "bucket 3")
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="known sums for 2 buffers"):
        InFlightChecksums([buf], KnownSums(torch.zeros(2, 2, dtype=torch.int64), [[], []]))
