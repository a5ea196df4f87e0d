"""Checksums read many at once (one device read for all) agree with one bucket at a time."""

import pytest
import torch

from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum, from_many_sums, word_sums


def _buffers():
    g = torch.Generator().manual_seed(3)
    # whole words, and 1-3 tail bytes past the last whole word; one of a single tail byte only
    return [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (64, 65, 66, 67, 4096 + 3, 1)]


def test_from_many_sums_equals_bucket_checksum_for_every_tail_length():
    bufs = _buffers()
    sums = [word_sums(b[: b.numel() - b.numel() % 4].view(torch.int32)) for b in bufs]
    tails = [b[b.numel() - b.numel() % 4 :] for b in bufs]
    got = from_many_sums(sums, tails, [b.numel() for b in bufs])
    assert got == [bucket_checksum(b) for b in bufs]
    assert len(set(got)) == len(got)
    assert from_many_sums([], [], []) == []
    with pytest.raises(ValueError, match="2 sums, 1 tails and 2 sizes"):
        from_many_sums(sums[:2], tails[:1], [1, 2])


def test_in_flight_checksums_off_the_gpu_are_the_bucket_checksums_read_one_or_all():
    bufs = _buffers()
    want = [bucket_checksum(b) for b in bufs]
    one = InFlightChecksums(bufs)
    assert len(one) == len(bufs)
    assert one.value(2) == want[2] and one.values() == want
    one.release()  # nothing queued off the GPU: a no-op
    with pytest.raises(ValueError, match="checksum wants flat uint8 buffers, got torch.int32"):
        InFlightChecksums([bufs[0].view(torch.int32)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_in_flight_checksums_on_the_gpu_equal_the_cpu_ones():
    bufs = _buffers()
    on_gpu = InFlightChecksums([b.cuda() for b in bufs])
    assert on_gpu.value(0) == bucket_checksum(bufs[0])
    assert on_gpu.values() == [bucket_checksum(b) for b in bufs]
    on_gpu.release()
