"""GPU suite for the weight bus (run on a GPU host: pytest -m gpu tests/gpu). CI has no GPU."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("nbytes", [0, 3, 4, 7, (1 << 20) - 4, (1 << 20) + 4, (64 << 20) + 3, (300 << 20) + 2])
def test_checksum_is_identical_on_gpu_and_cpu(nbytes):
    from weightsync.bus.copy import checksum_triton
    from weightsync.bus.copy.checksum import bucket_checksum

    g = torch.Generator().manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    # the fused kernel is what runs on GPU hosts (triton ships with CUDA torch); its partial sums
    # span many programs at the larger sizes, and must add up exactly as the CPU's do
    assert checksum_triton.available()
    assert bucket_checksum(buf) == bucket_checksum(buf.cuda())
    if nbytes >= 4:
        buf[nbytes // 2] ^= 1  # one flipped bit changes the value on both devices alike
        assert bucket_checksum(buf) == bucket_checksum(buf.cuda())


@needs_cuda
def test_in_flight_checksums_of_many_buffers_in_one_launch_equal_the_cpu_ones():
    """Buffers of unequal lengths (the longest spans many programs, one is shorter than a word,
    one empty), tail bytes, the same layout twice (its table reused) and a changed byte."""
    from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum

    g = torch.Generator().manual_seed(7)
    sizes = [(3 << 20) + 1, (64 << 20) + 6, 2, 4096, (17 << 20) + 3, 0, 12]
    cpu = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    want = [bucket_checksum(b) for b in cpu]
    gpu = [b.cuda() for b in cpu]
    first = InFlightChecksums(gpu)
    assert first.value(0) == want[0] and first.value(3) == want[3] and first.values() == want
    first.release()
    again = InFlightChecksums(gpu)  # the same layout: the table built above
    assert again.values() == want
    flipped = [b.clone() for b in gpu]
    flipped[4][12345] ^= 0x10
    assert InFlightChecksums(flipped).values() == want[:4] + [bucket_checksum(flipped[4].cpu())] + want[5:]
    assert bucket_checksum(flipped[4].cpu()) != want[4]


@needs_cuda
@pytest.mark.parametrize("nbytes", [4, 8, (1 << 20) - 4, (1 << 20) + 4, (300 << 20) + 8])
def test_copy_out_kernel_copies_exactly_and_sums_as_the_cpu_does(nbytes):
    from weightsync.bus.copy.checksum import copy_word_sums, word_sums

    g = torch.Generator().manual_seed(nbytes)
    words = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=g)
    dst = torch.empty_like(words, device="cuda:0")
    got = copy_word_sums(words.cuda(), dst)
    assert torch.equal(dst.cpu(), words)
    assert got.cpu().tolist() == word_sums(words).tolist()


@needs_cuda
def test_copy_into_cuda_parameters_lands_exactly_with_the_bucket_checksum():
    """The rollout's one-pass copy-out (copy/verified_copy.py) on the GPU: bf16 tensors of a Qwen-like mix,
    odd sizes included, into separately allocated CUDA tensors."""
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.copy.verified_copy import copy_bucket, copy_into
    from weightsync.bus.pack import alloc_buffer, pack_bucket
    from weightsync.bus.plan import TensorMeta, plan_buckets

    g = torch.Generator().manual_seed(0)
    shapes = [(3584, 3584), (3584,), (512, 3584), (7,), (18944, 3584), (3, 5)]
    named = [(f"t{i}", torch.randn(s, generator=g).to(torch.bfloat16).cuda()) for i, s in enumerate(shapes)]
    (plan,) = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 30)
    buf = alloc_buffer(plan.nbytes, torch.device("cuda:0"))
    view = pack_bucket(plan, iter(named), buf)
    dests = [torch.empty_like(t) for _, t in named]
    assert copy_into(plan, buf, dests) == bucket_checksum(view) == bucket_checksum(view.cpu())
    for (name, t), d in zip(named, dests):
        assert torch.equal(d.view(torch.int16), t.view(torch.int16)), name
    # the work table is kept per layout and addresses: new destinations get their own
    others = [torch.zeros_like(t) for _, t in named]
    assert copy_into(plan, buf, others) == bucket_checksum(view)
    assert all(torch.equal(o.view(torch.int16), t.view(torch.int16)) for o, (_, t) in zip(others, named))
    flat, csum = copy_bucket(plan, buf)
    assert csum == bucket_checksum(view) and torch.equal(flat, view)


_WARM_PROBE = """
import json, sys, time, torch
from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum, warm_up
warm = warm_up(torch.device("cuda:0"))
after = []
for nbytes in ((3 << 20), (3 << 20) + 4, (3 << 20) + 6, (1 << 30) + 2):  # sizes warm_up never saw
    buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    bucket_checksum(buf)
    after.append(time.perf_counter() - t0)
bufs = [torch.ones(n, dtype=torch.uint8, device="cuda:0") for n in ((5 << 20) + 2, 7 << 20, 1 << 20)]
torch.cuda.synchronize()
t0 = time.perf_counter()
InFlightChecksums(bufs).values()  # the in-place buckets' kernels
after.append(time.perf_counter() - t0)
print(json.dumps({"warm": warm, "after": after}))
"""


@needs_cuda
def test_checksum_warm_up_leaves_nothing_to_compile_for_the_first_sync():
    # a fresh process: nothing compiled in memory yet (Triton's disk cache may be warm, which is the
    # restart case the services meet too)
    out = subprocess.run(
        [sys.executable, "-c", _WARM_PROBE], check=True, timeout=300, cwd=ROOT, capture_output=True, text=True
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["warm"] > 0
    # a compile takes hundreds of ms; a warm checksum of 1 GiB about 0.5 ms at ~2.7 TB/s
    assert max(res["after"]) < 0.05, res


@needs_cuda
def test_nccl_init_without_peers_times_out_instead_of_hanging():
    from weightsync.bus.errors import TransportError
    from weightsync.bus.nccl import libnccl
    from weightsync.bus.nccl.group import NcclGroup

    t0 = time.monotonic()
    with pytest.raises(TransportError, match="did not complete within"):
        NcclGroup(libnccl.new_unique_id(), 2, 0, "cuda:0", timeout=5)
    assert time.monotonic() - t0 < 15


@needs_cuda
def test_bus_and_ipc_deliver_bit_exact_weights(tmp_path):
    """Two real processes (NCCL across 2 GPUs; IPC on one GPU): the engine's tensors equal the trainer's."""
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "bench_sync.py"),
        "--models",
        "0.5b",
        "--bucket-mb",
        "64",
        "--reps",
        "1",
        "--ipc-models",
        "0.5b",
        "--ipc-bucket-mb",
        "64",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, timeout=400, cwd=ROOT)
    res = json.loads(out.read_text())
    if torch.cuda.device_count() >= 2:
        assert res["nccl_1to1"][0]["exact"] is True
    assert res["ipc"][0]["exact"] is True
