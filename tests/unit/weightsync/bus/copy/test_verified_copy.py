"""The one-pass copy-out: the tensors land exactly, and the checksum equals bucket_checksum's."""

import pytest
import torch

from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.copy.verified_copy import copy_bucket, copy_into
from weightsync.bus.pack import alloc_buffer, pack_bucket, unpack_bucket
from weightsync.bus.plan import TensorMeta, plan_buckets


def _bucket(shapes_dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    named = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        t = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32).to(dtype)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g).to(dtype)
        named.append((f"t{i}", t))
    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
    (plan,) = plan_buckets(metas, 1 << 20)
    buf = alloc_buffer(plan.nbytes + 64, torch.device("cpu"))
    buf.fill_(0x5A)  # gaps hold whatever the sender left there: they count in the checksum
    view = pack_bucket(plan, iter(named), buf)
    return plan, buf, view, named


# odd byte counts (bf16 x 3 = 6 bytes, int8 x 7) end inside a word that the next gap finishes
SHAPES = [((5, 3), torch.bfloat16), ((7,), torch.int8), ((4, 4), torch.float32), ((3,), torch.bfloat16)]


def test_copy_into_lands_every_tensor_exactly_and_checksums_the_whole_bucket_with_its_gaps():
    plan, buf, view, named = _bucket(SHAPES)
    dests = [torch.empty_like(t) for _, t in named]
    got = copy_into(plan, buf, dests)
    assert got == bucket_checksum(view)
    for (name, t), d in zip(named, dests):
        assert torch.equal(d.view(torch.uint8), t.contiguous().view(torch.uint8)), name


def test_a_changed_gap_byte_changes_the_checksum_but_not_the_tensors():
    plan, buf, view, named = _bucket(SHAPES)
    before = copy_into(plan, buf, [torch.empty_like(t) for _, t in named])
    gap = plan.slots[0].offset + plan.slots[0].meta.nbytes  # first byte after tensor 0
    buf[gap + 1] ^= 0xFF
    assert copy_into(plan, buf, [torch.empty_like(t) for _, t in named]) != before


def test_copy_bucket_is_a_private_copy_with_the_same_checksum():
    plan, buf, view, named = _bucket(SHAPES + [((1,), torch.int8)])  # the bucket ends off a word boundary
    assert plan.nbytes % 4
    flat, csum = copy_bucket(plan, buf)
    assert csum == bucket_checksum(view) and torch.equal(flat, view)
    buf.zero_()  # the bus buffer is reused: the copy keeps the tensors
    for (name, t), (n2, v) in zip(named, unpack_bucket(plan, flat)):
        assert name == n2 and torch.equal(v.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_copy_into_declines_destinations_it_cannot_write_as_words_and_copies_nothing():
    plan, buf, view, named = _bucket(SHAPES)
    dests = [torch.zeros_like(t) for _, t in named]
    dests[2] = torch.zeros(4, 8, dtype=torch.float32)[:, ::2]  # not contiguous
    assert copy_into(plan, buf, dests) is None
    assert all(not d.any() for d in dests)
    odd = torch.zeros(2 + 5 * 3, dtype=torch.bfloat16)[1:16].view(5, 3)  # 2-byte aligned only
    assert copy_into(plan, buf, [odd, *dests[1:2], torch.zeros(4, 4), dests[3]]) is None
    with pytest.raises(ValueError, match="3 destinations for 4 tensors"):
        copy_into(plan, buf, dests[:3])


def test_pending_checksums_read_together_equal_each_read_alone():
    from weightsync.bus.copy.verified_copy import pending_values

    pending, want = [], []
    for seed in range(3):
        plan, buf, view, named = _bucket(SHAPES, seed=seed)
        _, p = copy_bucket(plan, buf, wait=False)
        pending.append(p)
        want.append(bucket_checksum(view))
    assert pending_values(pending) == [p.value() for p in pending] == want
    assert pending_values([]) == []


def test_a_slot_without_destination_is_neither_copied_nor_summed_and_its_own_sums_complete_the_checksum():
    """A None destination (block-FP8 trainer_writes: the fused kernel writes and sums that slot): its words
    are left out of the copy's sums, which plus the slot's own word sums are the bucket's; a slot that is
    not whole words cannot be left out."""
    from weightsync.bus.copy.checksum import from_sums, word_sums
    from weightsync.bus.copy.verified_copy import copy_all_into

    plan, buf, view, named = _bucket(SHAPES)
    dests = [torch.empty_like(t) for _, t in named]
    dests[2] = None  # the float32 slot: whole words
    pending = copy_into(plan, buf, dests, wait=False)
    s = plan.slots[2]
    own = word_sums(buf[s.offset : s.offset + s.meta.nbytes].view(torch.int32))
    n = plan.nbytes
    assert from_sums(pending.sums + own, pending.tail, n) == bucket_checksum(view)
    assert from_sums(pending.sums, pending.tail, n) != bucket_checksum(view)
    for i in (0, 1, 3):
        assert torch.equal(dests[i].view(torch.uint8), named[i][1].contiguous().view(torch.uint8))
    (all_one,) = copy_all_into([plan], [buf], [dests])
    assert torch.equal(all_one.sums, pending.sums)
    odd = [torch.empty_like(t) for _, t in named]
    odd[0] = None  # 6 bytes: not whole words
    assert copy_into(plan, buf, odd) is None
