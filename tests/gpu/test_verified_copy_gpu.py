"""verified_copy's fused copy-and-checksum on a real GPU, every kernel config of scatter_triton.CONFIGS
compiled: every destination byte equal to its slot and every bucket's checksum equal to bucket_checksum
of the same bytes on the CPU, with destinations 16-byte aligned and not, odd-sized tensors, gaps, a
tensor spanning many rows, one launch for all buckets and one per bucket.
Run: pytest -m gpu tests/gpu/test_verified_copy_gpu.py (the timings: bench/bench_verified_copy.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layout(dst_shift: int):
    from weightsync.bus.pack import pack_bucket
    from weightsync.bus.plan import TensorMeta, plan_buckets

    g = torch.Generator().manual_seed(5)
    shapes = [((3584, 1024), torch.bfloat16), ((7,), torch.int8), ((257,), torch.float32), ((255, 129), torch.bfloat16)]
    named = []
    for i, (shape, dtype) in enumerate(shapes * 4):
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=g, dtype=torch.uint8)
        named.append((f"t{i}", raw.view(dtype).view(shape)))
    plans = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], 16 << 20)
    cpu_bufs, it = [], iter(named)
    for p in plans:
        b = torch.randint(0, 256, (p.nbytes,), generator=g, dtype=torch.uint8)  # gaps: whatever was there
        pack_bucket(p, [next(it) for _ in p.slots], b)
        cpu_bufs.append(b)
    dst = torch.zeros(sum(t.numel() * t.element_size() + 64 for _, t in named) + 64, dtype=torch.uint8, device="cuda")
    dests, pos, it = [], dst_shift, iter(named)
    for p in plans:
        dests.append([])
        for k, _ in enumerate(p.slots):
            _, t = next(it)
            nb = t.numel() * t.element_size()
            dests[-1].append(dst[pos : pos + nb].view(t.dtype).view(t.shape))
            pos += (nb + 3) // 4 * 4 + 16 * (k % 3)  # some 16-byte aligned, some not
    return plans, cpu_bufs, dests, named


@needs_gpu
@pytest.mark.parametrize("dst_shift", [0, 4])
def test_every_config_copies_and_sums_exactly(dst_shift):
    from weightsync.bus.copy import scatter_triton
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.copy.verified_copy import copy_all_into, copy_into, pending_values

    plans, cpu_bufs, dests, named = _layout(dst_shift)
    bufs = [b.cuda() for b in cpu_bufs]
    want = [bucket_checksum(b) for b in cpu_bufs]
    for cfg in [*scatter_triton.CONFIGS.values(), None]:  # None: the configured default, as the sync runs it
        for d in dests:
            for t in d:
                t.zero_()
        assert pending_values(copy_all_into(plans, bufs, dests, kernel=cfg)) == want, cfg
        it = iter(named)
        for ds in dests:
            for d in ds:
                name, t = next(it)
                assert torch.equal(d.cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (cfg, name)
        assert copy_into(plans[0], bufs[0], dests[0], kernel=cfg) == want[0], cfg


@needs_gpu
def test_tp_shards_compiled_kernels_copy_and_sum_as_the_torch_reference():
    """shard_copy.copy_sharded_all on the GPU (the aligned-row kernel for the row shards and the whole tensors, its
    short-row form for a column shard of many rows) against copy_sharded on the CPU: the same bytes, the same
    common and shard sums; the two ranks' sums add up to the bucket's checksum."""
    from weightsync.bus.copy import shard_copy
    from weightsync.bus.copy.checksum import bucket_checksum, from_sums
    from weightsync.bus.pack import pack_bucket
    from weightsync.bus.plan import TensorMeta, plan_buckets

    g = torch.Generator().manual_seed(9)
    shapes = {"col": (4096, 896), "row": (896, 4864), "norm": (895,)}
    named = [(n, torch.randn(*s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]
    (plan,) = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], 64 << 20)
    buf = torch.randint(0, 256, (plan.nbytes,), generator=g, dtype=torch.uint8)
    pack_bucket(plan, named, buf)
    col, row, norm = plan.slots
    totals = []
    for rank in (0, 1):
        got = {}
        for device in ("cpu", "cuda"):
            b = buf.to(device)
            dst = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in
                   (("col", (2048, 896)), ("row", (896, 2432)), ("norm", (895,)))}  # fmt: skip
            pieces = [
                shard_copy.Piece(0, col.offset + rank * 2048 * 896 * 2, 1, 2048 * 896 * 2, 2048 * 896 * 2, dst["col"]),
                shard_copy.Piece(1, row.offset + rank * 2432 * 2, 896, 2432 * 2, 4864 * 2, dst["row"]),
                shard_copy.Piece(2, norm.offset, 1, 895 * 2, 895 * 2, dst["norm"]),
            ]
            sums = shard_copy.copy_sharded_all([plan], [b], [pieces], {})[0]
            got[device] = (sums.cpu(), {n: t.cpu() for n, t in dst.items()})
        assert torch.equal(got["cpu"][0], got["cuda"][0]), rank
        for n, t in got["cpu"][1].items():
            assert torch.equal(t, got["cuda"][1][n]), (rank, n)
        assert torch.equal(got["cuda"][1]["row"], named[1][1][:, rank * 2432 : (rank + 1) * 2432])
        totals.append(got["cuda"][0])
    whole = plan.nbytes - plan.nbytes % 4
    total = totals[0][0] + totals[0][1] + totals[1][1]
    assert from_sums(total, buf[whole : plan.nbytes], plan.nbytes) == bucket_checksum(buf[: plan.nbytes])
