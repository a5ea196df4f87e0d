"""scatter_rows.py / scatter_cuda.py: the aligned-row table covers every word of every region exactly once
(16-byte rows wherever source and destination allow it, single words elsewhere), and the kernel's copy
lands every byte and gives bucket_checksum's value for every config. The torch path runs everywhere; the
kernel (each config of scatter_cuda.CONFIGS, `legacy` included) through Triton's interpreter where triton
is installed (tests/gpu/test_verified_copy_gpu.py runs them compiled; test_scatter_compile.py compiles
them for sm_90)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.triton_cpu import rerun_under_interpreter
from weightsync.bus import scatter_cuda
from weightsync.bus.checksum import bucket_checksum
from weightsync.bus.pack import pack_bucket
from weightsync.bus.plan import TensorMeta, plan_buckets
from weightsync.bus.scatter_rows import COPY, COPY_VEC, SUM, VEC, rows_of
from weightsync.bus.verified_copy import copy_all_into, copy_into, pending_values

KERNEL_ENV = "SCATTER_KERNEL"


def _cover(rows, owner, src_base, dst_base):
    """{(bucket, source byte address): destination byte address or 0} of every word the rows name, and
    the set of those moved by 16-byte rows."""
    got, wide = {}, set()
    for (kind, s, d, n), b in zip(rows, owner):
        unit = VEC if kind == COPY_VEC else 1
        for k in range(n * unit):
            src = src_base + 4 * (s * unit + k)
            assert (b, src) not in got, "a word in two rows"
            got[(b, src)] = dst_base + 4 * (d * unit + k) if kind != SUM else 0
            if kind == COPY_VEC:
                assert src % 16 == 0 or k % VEC, "a 16-byte row starts off the boundary"
                wide.add((b, src))
    return got, wide


@pytest.mark.parametrize("src_shift,dst_shift", [(0, 0), (4, 4), (8, 4), (12, 0), (0, 8)])
def test_rows_cover_every_word_once_and_are_16_byte_rows_where_both_sides_allow(src_shift, dst_shift):
    base = 1 << 20
    src0, dst0 = base + 4096 + src_shift, base + (1 << 16) + dst_shift
    regions = [(0, 3, dst0), (3, 5, 0), (8, 1001, dst0 + 32 + src_shift - dst_shift), (1009, 2, 0), (1011, 40, dst0)]
    regions2 = [(0, 77, dst0 + 20000)]
    buckets = [(src0, regions), (src0 + 100_000, regions2)]
    rows, owner = rows_of(buckets, base, base, row_words=64)
    got, wide = _cover(rows, owner, base, base)
    want = {}
    for b, (addr, regs) in enumerate(buckets):
        for first, count, dst in regs:
            words = [(b, addr + 4 * (first + k)) for k in range(count)]
            want.update({w: dst + 4 * k if dst else 0 for k, w in enumerate(words)})
            n_wide = len(wide.intersection(words))
            if dst and (addr + 4 * first - dst) % 16 == 0:  # all but < 4 words at each end go 16 bytes wide
                assert n_wide >= count - 2 * (VEC - 1) if count >= 2 * VEC else True, (first, count)
            else:  # only summed, or the two sides never 16-byte aligned at once
                assert n_wide == 0, (first, count)
    assert got == want
    assert len(wide) >= 1001 - 2 * (VEC - 1)  # the large region, aligned alike in every case here
    for kind, *_, n in rows:
        assert 0 < n * (VEC if kind == COPY_VEC else 1) <= 64


def test_unaligned_bases_give_single_word_rows_and_bad_arguments_are_named():
    rows, _ = rows_of([(4096, [(0, 64, 8192)])], 4, 4, row_words=16)
    assert {k for k, *_ in rows} == {COPY} and sum(n for *_, n in rows) == 64
    with pytest.raises(ValueError, match="row_words=6"):
        rows_of([], 0, 0, row_words=6)
    with pytest.raises(ValueError, match="bucket 0: destination 0x2002"):
        rows_of([(4096, [(0, 4, 8194)])], 0, 0, row_words=16)
    with pytest.raises(ValueError, match="bucket 0: its words at 0x1002"):
        rows_of([(4098, [(0, 4, 8192)])], 0, 0, row_words=16)


def test_the_config_comes_from_the_debug_switches_and_a_wrong_name_lists_the_choices(monkeypatch):
    from weightsync import debug

    monkeypatch.setattr(debug, "_current", debug.Switches())
    assert scatter_cuda.config().name == scatter_cuda.DEFAULT
    debug.configure(debug.Switches(verified_copy="legacy"))
    assert scatter_cuda.config().kernel == "legacy"
    debug.configure(debug.Switches(verified_copy="fast"))
    with pytest.raises(ValueError, match="debug.verified_copy='fast'.*legacy"):
        scatter_cuda.config()
    assert all(c.row_words % VEC == 0 for c in scatter_cuda.CONFIGS.values())


# ---- the copy itself: torch here, every kernel config in the interpreter's subprocess ---------------------
# odd byte counts (bf16 x 3 = 6 bytes, int8 x 7) end inside a word; a tensor larger than a row
SHAPES = [((5, 3), torch.bfloat16), ((7,), torch.int8), ((4, 4), torch.float32), ((300, 37), torch.bfloat16)]


def _buckets(dst_shift: int):
    g = torch.Generator().manual_seed(1)
    named = []
    for i, (shape, dtype) in enumerate(SHAPES * 3 + [((3,), torch.int8)]):  # the last bucket ends mid-word
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=g, dtype=torch.uint8)
        named.append((f"t{i}", raw.view(dtype).view(shape)))  # any bits: NaN payloads too
    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
    plans = plan_buckets(metas, 16 << 10)
    assert len(plans) >= 2 and plans[-1].nbytes % 4
    flat = torch.randint(0, 256, (sum(p.nbytes + 512 for p in plans),), generator=g, dtype=torch.uint8)
    bufs, pos, it = [], 0, iter(named)
    for p in plans:
        bufs.append(flat[pos : pos + p.nbytes])
        pack_bucket(p, [next(it) for _ in p.slots], bufs[-1])
        pos += (p.nbytes + 511) // 512 * 512
    dst = torch.zeros(sum(t.numel() * t.element_size() + 64 for _, t in named) + 64, dtype=torch.uint8)
    dests, pos, it = [], dst_shift, iter(named)
    for p in plans:
        dests.append([])
        for _ in p.slots:
            _, t = next(it)
            nb = t.numel() * t.element_size()
            dests[-1].append(dst[pos : pos + nb].view(t.dtype).view(t.shape))
            pos += (nb + 3) // 4 * 4 + 16 * (len(dests[-1]) % 3)  # some 16-byte aligned, some not
    return plans, bufs, dests, named


def _configs(use_kernel: bool):
    return list(scatter_cuda.CONFIGS.values()) if use_kernel else [None]


@pytest.fixture
def use_kernel():
    """True only in the subprocess of test_the_kernel_configs_copy_and_sum_exactly (TRITON_INTERPRET=1)."""
    return os.environ.get(KERNEL_ENV) == "1"


def test_the_kernel_configs_copy_and_sum_exactly():
    """Every other test of this file again, each kernel config run by Triton's interpreter."""
    rerun_under_interpreter(__file__, "the_kernel_configs_copy", KERNEL_ENV)


@pytest.mark.parametrize("dst_shift", [0, 4])
def test_copy_all_into_lands_every_byte_and_gives_bucket_checksum(use_kernel, dst_shift):
    for cfg in _configs(use_kernel):
        plans, bufs, dests, named = _buckets(dst_shift)
        got = pending_values(copy_all_into(plans, bufs, dests, kernel=cfg))
        assert got == [bucket_checksum(b) for b in bufs], cfg
        it = iter(named)
        for ds in dests:
            for d in ds:
                name, t = next(it)
                assert torch.equal(d.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (cfg, name)


def test_copy_into_one_bucket_and_a_changed_gap_word_changes_the_checksum(use_kernel):
    for cfg in _configs(use_kernel):
        plans, bufs, dests, _ = _buckets(4)
        plan, buf = plans[0], bufs[0]
        assert copy_into(plan, buf, dests[0], kernel=cfg) == bucket_checksum(buf), cfg
        gap = plan.slots[0].offset + plan.slots[0].meta.nbytes + 2
        buf[gap] ^= 0x10
        assert copy_into(plan, buf, dests[0], kernel=cfg) == bucket_checksum(buf), cfg


def test_prepared_buffers_skip_the_checks_and_give_the_same_bytes_and_sums(use_kernel, monkeypatch):
    """copy_all_into's `prepared` (trainer_writes.Destinations keeps one): the second call on the same
    buffers goes straight to its launch; other buffers are checked again."""
    from weightsync.bus import verified_copy

    for cfg in _configs(use_kernel):
        plans, bufs, dests, _ = _buckets(0)
        want = [bucket_checksum(b) for b in bufs]
        prepared: dict = {}
        assert pending_values(copy_all_into(plans, bufs, dests, kernel=cfg, prepared=prepared)) == want, cfg
        assert len(prepared) == 1
        checked: list = []

        def counting(*a, checked=checked, real=verified_copy._laid_out):
            checked.append(a)
            return real(*a)

        monkeypatch.setattr(verified_copy, "_laid_out", counting)
        for ds in dests:
            for d in ds:
                d.zero_()
        bufs[1][plans[1].slots[0].offset] ^= 0x01  # new bytes in the same buffers: new sums
        want = [bucket_checksum(b) for b in bufs]
        assert pending_values(copy_all_into(plans, bufs, dests, kernel=cfg, prepared=prepared)) == want, cfg
        assert checked == []
        for p, b, ds in zip(plans, bufs, dests):  # every byte landed again, the changed one included
            for slot, d in zip(p.slots, ds):
                assert torch.equal(d.reshape(-1).view(torch.uint8), b[slot.offset : slot.offset + slot.meta.nbytes])
        moved = [b.clone() for b in bufs]  # other buffers: checked again
        assert pending_values(copy_all_into(plans, moved, dests, kernel=cfg, prepared=prepared)) == want, cfg
        assert len(checked) == len(plans) and len(prepared) == 2
        monkeypatch.undo()


def test_pending_values_read_one_launchs_rows_at_once_and_loose_sums_alike():
    from weightsync.bus.verified_copy import PendingChecksum, _shared_rows

    rows = torch.tensor([[1, 2], [3, -4], [5, 6]], dtype=torch.int64)
    tails = [torch.empty(0, dtype=torch.uint8)] * 3
    shared = [PendingChecksum(rows[i], tails[i], 8 + i, rows=rows, row=i) for i in range(3)]
    loose = [PendingChecksum(rows[i].clone(), tails[i], 8 + i) for i in range(3)]
    assert _shared_rows(shared) is rows and _shared_rows(loose) is None
    assert _shared_rows(shared[::-1]) is None and _shared_rows(shared[:2]) is None
    assert pending_values(shared) == pending_values(loose) == [p.value() for p in loose]
