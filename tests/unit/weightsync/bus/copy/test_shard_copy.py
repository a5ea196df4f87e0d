"""copy/shard_copy.py: a TP rank's shards copied out of a bucket, its `common` and `shard` word sums; the ranks'
sums add up to the bucket's checksum (torch reference, and the tables the kernel runs, executed here word by
word on the CPU as the kernel would: tests/gpu runs none of this yet)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from weightsync.bus.copy import scatter_triton, shard_copy
from weightsync.bus.copy.checksum import bucket_checksum, from_sums
from weightsync.bus.copy.scatter_rows import COPY_VEC, SUM, VEC
from weightsync.bus.copy.shard_copy import Piece
from weightsync.bus.pack import alloc_buffer, pack_bucket
from weightsync.bus.plan import TensorMeta, plan_buckets

H = 8


def _bucket(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"col": (2 * H, H), "row": (H, 4 * H), "norm": (7,)}  # norm: 14 bytes, a partial last word
    named = [(n, torch.randn(*s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]
    (plan,) = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 20)
    buf = alloc_buffer(plan.nbytes)
    buf.fill_(0x5A)
    pack_bucket(plan, named, buf)
    return plan, buf, dict(named)


def _rank_pieces(plan, rank: int):
    """Rank `rank` of 2: rows of `col`, columns of `row`, `norm` whole; its destinations."""
    col, row, norm = plan.slots
    dst = {
        "col": torch.zeros(H, H, dtype=torch.bfloat16),
        "row": torch.zeros(H, 2 * H, dtype=torch.bfloat16),
        "norm": torch.zeros(7, dtype=torch.bfloat16),
    }
    pieces = [
        Piece(0, col.offset + rank * H * H * 2, 1, H * H * 2, H * H * 2, dst["col"]),
        Piece(1, row.offset + rank * 2 * H * 2, H, 2 * H * 2, 4 * H * 2, dst["row"]),
        Piece(2, norm.offset, 1, 14, 14, dst["norm"]),
    ]
    return pieces, dst


def _total(plan, buf, sums_of_ranks):
    common = {tuple(s[0].tolist()) for s in sums_of_ranks}
    assert len(common) == 1, "the ranks' common sums differ"
    total = sums_of_ranks[0][0] + sum(s[1] for s in sums_of_ranks)
    whole = plan.nbytes - plan.nbytes % 4
    return from_sums(total, buf[whole : plan.nbytes], plan.nbytes)


def _holds(dst, named, rank):
    assert torch.equal(dst["col"], named["col"][rank * H : (rank + 1) * H])
    assert torch.equal(dst["row"], named["row"][:, rank * 2 * H : (rank + 1) * 2 * H])
    assert torch.equal(dst["norm"], named["norm"])


def test_the_ranks_sums_add_up_to_the_buckets_checksum_and_each_holds_its_shards():
    plan, buf, named = _bucket()
    sums = []
    for rank in (0, 1):
        pieces, dst = _rank_pieces(plan, rank)
        assert shard_copy.check(plan, pieces) == ""
        sums.append(shard_copy.copy_sharded(plan, buf, pieces))
        _holds(dst, named, rank)
        # common: the gaps and the norm; shard: half of col and of row
        gaps = plan.nbytes - sum(s.meta.nbytes for s in plan.slots)
        assert shard_copy.bytes_read(plan, pieces) == gaps + 12 + (H * H + H * 2 * H) * 2
    assert _total(plan, buf, sums) == bucket_checksum(buf[: plan.nbytes])
    # one rank's shard sums twice (rank 1 reports rank 0's): another total, the sync fails
    assert _total(plan, buf, [sums[0], sums[0]]) != bucket_checksum(buf[: plan.nbytes])


def test_shards_inside_a_word_are_refused():
    plan, _, _ = _bucket()
    col = plan.slots[0]
    odd = Piece(0, col.offset + 2, 1, 8, 8, torch.zeros(4, dtype=torch.bfloat16))
    assert "starts inside a 4-byte word" in shard_copy.check(plan, [odd])
    row = plan.slots[1]
    narrow = Piece(1, row.offset, H, 6, 4 * H * 2, torch.zeros(H, 3, dtype=torch.bfloat16))
    assert "rows are not whole 4-byte words" in shard_copy.check(plan, [narrow])
    half = Piece(1, row.offset, H, 2 * H * 2, 4 * H * 2, torch.zeros(H, 2 * H, dtype=torch.bfloat16))
    again = Piece(1, row.offset + H * 2, H, 2 * H * 2, 4 * H * 2, torch.zeros(H, 2 * H, dtype=torch.bfloat16))
    other = Piece(1, row.offset + 2 * H * 2, H, 2 * H * 2, 4 * H * 2, torch.zeros(H, 2 * H, dtype=torch.bfloat16))
    assert "copied from the same bytes" in shard_copy.check(plan, [half, again])  # columns 8..15 twice
    assert shard_copy.check(plan, [half, other]) == ""  # both column halves: one rank at tp=1


def _run_rows(anchor: torch.Tensor, table: torch.Tensor, cfg, dst_anchor: torch.Tensor | None = None) -> torch.Tensor:
    """What scatter_triton's kernels do with a table, word by word (source addresses from `anchor`,
    destinations from `dst_anchor`, default the same)."""
    base = anchor.data_ptr()
    dst_base = base if dst_anchor is None else dst_anchor.data_ptr()
    out = torch.zeros(table.shape[0], 2, dtype=torch.int64)
    for r, (kind, s, d, n) in enumerate(table.tolist()):
        unit = VEC if kind == COPY_VEC else 1
        src = np.ctypeslib.as_array((ctypes.c_int32 * (n * unit)).from_address(base + 4 * s * unit))
        w = src.astype(np.int64)
        out[r, 0] = int(w.sum())
        out[r, 1] = int((src * src).astype(np.int64).sum())  # squares wrap in int32
        if kind != SUM:
            np.ctypeslib.as_array((ctypes.c_int32 * (n * unit)).from_address(dst_base + 4 * d * unit))[:] = src
    return out


def test_the_kernels_tables_copy_and_sum_as_the_reference(monkeypatch):
    plan, buf, named = _bucket(1)
    want = [shard_copy.copy_sharded(plan, buf, _rank_pieces(plan, r)[0]) for r in (0, 1)]
    monkeypatch.setattr(shard_copy, "_fused", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    launched = []

    def launch(src, dst, table, cfg, short=False):
        launched.append((short, table.shape[0]))
        return _run_rows(src, table, cfg)

    monkeypatch.setattr(scatter_triton, "launch", launch)
    for rank in (0, 1):
        pieces, dst = _rank_pieces(plan, rank)
        cache = {}
        for _ in range(2):  # the second call from the tables kept in `cache`
            got = shard_copy.copy_sharded_all([plan], [buf], [pieces], cache)
            assert torch.equal(got[0], want[rank]), rank
            _holds(dst, named, rank)
    # the column shard's 8 rows went to the short-row kernel, the rest to the aligned-row one
    assert {short for short, _ in launched} == {False, True}


def test_tables_counted_from_the_buffer_serve_another_buffer_of_the_same_layout(monkeypatch):
    """src_relative (rollout-svc's write of a received bucket, rollout_svc/engine/sglang_shards.py): the receiver
    hands each sync's buckets in fresh buffers; the tables are built once and copy exactly from any of them."""
    plan, buf, named = _bucket(1)
    monkeypatch.setattr(shard_copy, "_fused", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(
        scatter_triton, "launch", lambda src, dst, table, cfg, short=False: _run_rows(src, table, cfg, dst)
    )
    built = []
    real = shard_copy._tables
    monkeypatch.setattr(shard_copy, "_tables", lambda *a: built.append(1) or real(*a))
    other = torch.zeros(buf.numel() + 64, dtype=torch.uint8)
    at = (-other.data_ptr() % 16) + 16  # another address, the same alignment
    other = other[at : at + buf.numel()]
    other.copy_(buf)
    for rank in (0, 1):
        want = shard_copy.copy_sharded(plan, buf, _rank_pieces(plan, rank)[0])
        pieces, dst = _rank_pieces(plan, rank)
        cache, built[:] = {}, []
        for source in (buf, other, buf):
            for d in dst.values():
                d.zero_()
            got = shard_copy.copy_sharded_all([plan], [source], [pieces], cache, src_relative=True)
            assert torch.equal(got[0], want), rank
            _holds(dst, named, rank)
        assert len(built) == 1, f"the tables were built {len(built)} times for one layout"
