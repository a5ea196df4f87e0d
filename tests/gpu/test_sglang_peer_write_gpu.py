"""rollout-svc's write of SGLang TP ranks' shards across GPUs (rollout_svc/engine/sglang_shards.py `write_rank`):
a bucket received on cuda:1, TP rank 0's parameters on cuda:0 and rank 1's on cuda:1. Rank 0's pieces are
written by the copy-and-checksum kernel on cuda:1 through peer access (NVLink), or after one peer copy of the
bucket to cuda:0 (the fallback without peer access); both must land exactly the trainer's bytes of each shard
(a row range, a column range's rows, a tensor held whole with a 2-byte tail) and their sums must add up to the
bucket's checksum. The last test writes into memory another process shares by CUDA IPC, as SGLang's are."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.plan import TensorMeta, plan_buckets

pytestmark = pytest.mark.gpu
H, C = 512, 1024  # `col`: 2H x C, row-sharded; `row`: H x C, column-sharded; `norm`: 7 elements, whole


def _need_two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("triton")


def _bucket(device):
    from weightsync.bus.pack import alloc_buffer, pack_bucket

    g = torch.Generator().manual_seed(7)
    named = {
        "col": torch.randn(2 * H, C, generator=g).to(torch.bfloat16),
        "row": torch.randn(H, C, generator=g).to(torch.bfloat16),
        "norm": torch.randn(7, generator=g).to(torch.bfloat16),
    }
    (plan,) = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named.items()], 64 << 20)
    buf = alloc_buffer(plan.nbytes)
    buf.fill_(0x5A)
    pack_bucket(plan, list(named.items()), buf)
    return plan, buf.to(device), named


def _pieces(plan, rank: int, dsts: dict):
    """Rank `rank`'s pieces (as sglang_loader learns them from SGLang's parallel layers) into `dsts`."""
    from weightsync.bus.copy.shard_copy import Piece

    col, row, norm = plan.slots
    half = C // 2 * 2  # a rank's columns of `row`, in bytes
    return [
        Piece(0, col.offset + rank * H * C * 2, 1, H * C * 2, H * C * 2, dsts["col"]),
        Piece(1, row.offset + rank * half, H, half, C * 2, dsts["row"]),
        Piece(2, norm.offset, 1, 14, 14, dsts["norm"]),
    ]


def _want(named, rank: int) -> dict:
    return {
        "col": named["col"][rank * H : (rank + 1) * H],
        "row": named["row"][:, rank * C // 2 : (rank + 1) * C // 2].contiguous(),
        "norm": named["norm"],
    }


def _dsts(device) -> dict:
    return {
        "col": torch.full((H, C), float("nan"), dtype=torch.bfloat16, device=device),
        "row": torch.full((H, C // 2), float("nan"), dtype=torch.bfloat16, device=device),
        "norm": torch.full((7,), float("nan"), dtype=torch.bfloat16, device=device),
    }


def _write_both(plan, buf, dsts_by_rank, peer: bool) -> int:
    """Both ranks' writes (rank 0 from cuda:1 with `peer`, else after a peer copy); the bucket's checksum."""
    from rollout_svc.engine.sglang_shards import _combined, enable_peer, write_rank
    from weightsync.bus.copy.verified_copy import PendingChecksum

    sums = []
    for rank, dsts in enumerate(dsts_by_rank):
        pieces = _pieces(plan, rank, dsts)
        dev = pieces[0].dst.device
        ok = enable_peer(buf.device, dev) if peer else dev == buf.device
        sums.append(write_rank(plan, buf, pieces, {}, ok, {}).cpu().tolist())
    whole = plan.nbytes - plan.nbytes % 4
    return PendingChecksum(_combined(plan.index, sums), buf[whole : plan.nbytes].cpu(), plan.nbytes).value()


@pytest.mark.parametrize("peer", [True, False], ids=["peer-write", "peer-copy-first"])
def test_each_ranks_shards_land_exactly_from_the_receive_gpu(peer):
    from weightsync.bus.copy.checksum import bucket_checksum

    _need_two_gpus()
    if peer and not torch.cuda.can_device_access_peer(1, 0):
        pytest.skip("no peer access between cuda:1 and cuda:0")
    plan, buf, named = _bucket("cuda:1")
    dsts_by_rank = [_dsts("cuda:0"), _dsts("cuda:1")]
    got = _write_both(plan, buf, dsts_by_rank, peer)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert got == bucket_checksum(buf[: plan.nbytes].cpu())
    for rank, dsts in enumerate(dsts_by_rank):
        for name, want in _want(named, rank).items():
            have = dsts[name].cpu()
            assert torch.equal(have.view(torch.int16), want.view(torch.int16)), f"rank {rank} {name}"


def _owner(q_out, q_in):
    """Another process's parameters on cuda:0, shared by CUDA IPC (as SGLang's TP rank 0 shares them)."""
    dsts = _dsts("cuda:0")
    q_out.put(dsts)
    q_in.get(timeout=120)  # written
    torch.cuda.synchronize(0)
    q_out.put({n: t.cpu() for n, t in dsts.items()})
    q_in.get(timeout=120)


def test_the_peer_copy_first_write_lands_in_another_processs_ipc_shared_memory():
    """rollout-svc's default for a rank on another GPU (`peer_writes` off): the kernel writing through peer
    access faulted with an illegal address into CUDA-IPC-mapped memory on 2xH200 (2026-11-28)."""
    import torch.multiprocessing as mp

    from weightsync.bus.copy.checksum import bucket_checksum

    _need_two_gpus()
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_owner, args=(q_out, q_in), daemon=True)
    proc.start()
    try:
        mapped = q_out.get(timeout=120)  # opened here by CUDA IPC, on cuda:0
        plan, buf, named = _bucket("cuda:1")
        got = _write_both(plan, buf, [mapped, _dsts("cuda:1")], peer=False)
        assert got == bucket_checksum(buf[: plan.nbytes].cpu())
        q_in.put("written")
        seen = q_out.get(timeout=120)  # what the owner reads in its own process
        for name, want in _want(named, 0).items():
            assert torch.equal(seen[name].view(torch.int16), want.view(torch.int16)), name
        q_in.put("done")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
