"""The table-driven copy kernel (weightsync/bus/copy/copy_runs.py) compiled on a GPU: bit for bit what
torch's copies write, for a 7B layer's QKV split per query group, norms cast from float32 (NaNs
included), a padded vocabulary, slots at aligned and unaligned offsets; the gaps around the slots untouched."""

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("start", [0, 3])
def test_batched_copy_kernel_writes_what_torch_writes(start):
    from trainer_svc.actor.megatron.rules.transforms import QKV
    from weightsync.bus.copy import copy_runs_triton
    from weightsync.bus.copy.copy_runs import BatchedCopy
    from weightsync.model_spec import Dims

    assert copy_runs_triton.available()
    d = Dims(
        num_layers=2, hidden_size=3584, num_heads=28, num_query_groups=4, head_dim=128, ffn_hidden_size=18944,
        vocab_size=152000,
    )  # fmt: skip
    dev = torch.device("cuda:0")
    g = torch.Generator(device=dev).manual_seed(start)
    rows = 4 * (7 + 2) * 128
    srcs = [
        torch.randn(rows, 3584, device=dev, generator=g).to(torch.bfloat16),  # QKV weight
        torch.randn(rows, device=dev, generator=g).to(torch.bfloat16),  # QKV bias
    ]
    norms = [torch.randn(3584, device=dev, generator=g) * 3 for _ in range(3)]  # fp32, cast into bf16 slots
    norms[0][:4] = torch.tensor([1.00390625, 1.01171875, 3.3961e38, 2**-133], device=dev)
    # a diverged norm: NaNs of both signs and several payloads are what torch's CUDA cast writes
    nan_words = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64, device=dev)
    norms[1][:4] = nan_words.to(torch.int32).view(torch.float32)
    emb = torch.randn(152064, 64, device=dev, generator=g).to(torch.bfloat16)  # padded rows dropped
    want = [*QKV.to_hf(srcs[0], d), *QKV.to_hf(srcs[1], d), *(n.to(torch.bfloat16) for n in norms), emb[:152000]]
    flat = torch.full((start + sum(w.numel() for w in want) + 7,), float("nan"), dtype=torch.bfloat16, device=dev)
    outs, pos = [], start
    for w in want:
        outs.append(flat[pos : pos + w.numel()].view(w.shape))
        pos += w.numel()
    pairs = QKV.hf_copies(srcs[0], outs[0:3], d) + QKV.hf_copies(srcs[1], outs[3:6], d)
    pairs += list(zip(outs[6:9], norms)) + [(outs[9], emb.narrow(0, 0, 152000))]
    bc = BatchedCopy(pairs)
    assert bc.torch_pairs == 0 and 1 <= len(bc.launches) <= 4
    for _ in range(2):  # the table is reused: a second run writes the same
        bc.run()
        torch.cuda.synchronize(dev)
        for o, w in zip(outs, want, strict=True):
            assert torch.equal(o.view(torch.int16), w.contiguous().view(torch.int16))
    assert flat[:start].isnan().all() and flat[pos:].isnan().all()
    # against torch's own copies of the same pairs, one kernel each
    ref = torch.full_like(flat, float("nan"))
    ref_dsts = [ref.as_strided(dst.shape, dst.stride(), dst.storage_offset()) for dst, _ in pairs]
    torch._foreach_copy_(ref_dsts, [src for _, src in pairs])
    assert torch.equal(ref.view(torch.int16), flat.view(torch.int16))
