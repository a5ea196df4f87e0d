"""The hf actor's parameters moved into the manifest's bucket layout, so a GPU sync skips the pack copy.

Checked on the CPU (the move itself is device-independent; the sync uses it only on a GPU):
the flat buffers hold exactly what packing the export would, the parameters live in them and
keep working (forward, in-place load), and another dtype or an undigested layout is declined.
"""

from __future__ import annotations

import torch

from trainer_svc.actor.hf.actor import HfActor
from weightsync.bus.layout import ManifestCache
from weightsync.bus.pack import pack_bucket
from weightsync.models import resolve_model


def _actor(param_dtype=torch.bfloat16, export_dtype=torch.bfloat16) -> HfActor:
    config, _ = resolve_model("tiny-qwen2")
    return HfActor(config, seed=3, export_dtype=export_dtype, param_dtype=param_dtype)


def _manifest(actor, bucket_bytes=16 << 10):
    return ManifestCache().manifest(
        actor.export_metas(), version=1, sync_id="s", bucket_bytes=bucket_bytes, model_family=actor.family
    )


def test_parameters_move_into_the_bucket_layout_and_keep_working():
    actor = _actor()
    m = _manifest(actor)
    assert len(m.buckets) > 2
    ids = torch.tensor([[1, 5, 9, 11]])
    with torch.no_grad():
        before = actor.model(ids).logits.clone()
    exported = {n: t.clone() for n, t in actor.export_tensors()}
    flats = actor.flat_buckets(m)
    assert flats is not None and len(flats) == len(m.buckets)
    for plan, flat in zip(m.buckets, flats):
        want = torch.zeros(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, ((s.meta.name, exported[s.meta.name]) for s in plan.slots), want)
        assert torch.equal(flat, want), plan.index  # byte for byte, padding included
    params = dict(actor.model.named_parameters())
    for plan, flat in zip(m.buckets, flats):
        for s in plan.slots:
            p = params[s.meta.name]
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert p.storage_offset() * p.element_size() == s.offset
    with torch.no_grad():
        assert torch.equal(actor.model(ids).logits, before)
        params["model.norm.weight"].add_(1.0)  # training writes the parameters: the bucket sees it
    plan, slot = next((b, s) for b in m.buckets for s in b.slots if s.meta.name == "model.norm.weight")
    view = flats[plan.index][slot.offset : slot.offset + slot.meta.nbytes].view(torch.bfloat16)
    assert torch.equal(view, exported["model.norm.weight"] + 1.0)
    assert actor.flat_buckets(m) is flats  # once per layout
    m2 = _manifest(actor, bucket_bytes=32 << 10)  # another layout: moved again, same values
    flats2 = actor.flat_buckets(m2)
    assert flats2 is not flats and len(flats2) == len(m2.buckets)
    with torch.no_grad():
        params["model.norm.weight"].sub_(1.0)
        assert torch.equal(actor.model(ids).logits, before)


def test_declined_when_the_parameters_are_not_the_export_as_they_are():
    fp32 = _actor(param_dtype=torch.float32, export_dtype=torch.bfloat16)
    assert fp32.flat_buckets(_manifest(fp32)) is None
    actor = _actor()
    m = _manifest(actor)
    m.layout_digest = ""
    assert actor.flat_buckets(m) is None


def test_a_block_fp8_layout_is_declined_so_the_sync_packs_the_quantized_export():
    """The stream phase now asks every actor for flat buckets of a quantized layout too (megatron's
    quantizes into them); the hf actor has no FP8 slots of its own and must say None."""
    from weightsync.formats.fp8.export import export_metas
    from weightsync.formats.fp8.spec import BLOCK_FP8

    actor = _actor(export_dtype=torch.float32)
    m = ManifestCache().manifest(
        export_metas(actor.export_metas()), version=1, sync_id="s", bucket_bytes=16 << 10, quantization=BLOCK_FP8
    )
    assert actor.flat_buckets(m) is None
    assert all(p.untyped_storage().size() == p.numel() * p.element_size() for p in actor.model.parameters())
