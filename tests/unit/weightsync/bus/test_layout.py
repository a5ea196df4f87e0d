"""Layout digests and the two layout caches (trainer: ManifestCache, rollout: KnownLayouts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weightsync.bus.layout import KnownLayouts, ManifestCache, compact_proto, layout_digest
from weightsync.bus.plan import ALIGN, TensorMeta, make_manifest, manifest_from_proto, manifest_to_proto


def _metas(n: int = 6, dtype=torch.bfloat16) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", (i + 3, 5), dtype) for i in range(n)]


def _plan(cache: ManifestCache, metas, sync_id="s1", version=1, bucket_bytes=1 << 10, **kw):
    return cache.manifest(
        metas,
        version=version,
        sync_id=sync_id,
        bucket_bytes=bucket_bytes,
        model_family="qwen2",
        checksum_algo="ws-sum64-v1",
        origin="o",
        **kw,
    )


def test_digest_names_the_layout_not_the_sync():
    metas = _metas()
    a = make_manifest(metas, version=1, sync_id="a", bucket_bytes=1 << 10, origin="x")
    b = make_manifest(metas, version=9, sync_id="b", bucket_bytes=1 << 10, origin="y")
    assert layout_digest(a) == layout_digest(b)
    changed = [
        make_manifest(metas, version=1, sync_id="a", bucket_bytes=2 << 10),  # bucket size
        make_manifest(_metas(dtype=torch.float16), version=1, sync_id="a", bucket_bytes=1 << 10),  # dtype
        make_manifest(metas[:-1], version=1, sync_id="a", bucket_bytes=1 << 10),  # one tensor fewer
        make_manifest(
            [dataclasses.replace(metas[0], shape=(3, 6)), *metas[1:]], version=1, sync_id="a", bucket_bytes=1 << 10
        ),  # a shape
        make_manifest(
            [dataclasses.replace(metas[0], name="u0"), *metas[1:]], version=1, sync_id="a", bucket_bytes=1 << 10
        ),  # a name
        make_manifest(metas, version=1, sync_id="a", bucket_bytes=1 << 10, checksum_algo="none"),
        make_manifest(metas, version=1, sync_id="a", bucket_bytes=1 << 10, model_family="llama"),
    ]
    digests = {layout_digest(m) for m in changed}
    assert len(digests) == len(changed) and layout_digest(a) not in digests


def test_manifest_cache_plans_once_per_layout_and_replans_on_change():
    cache, metas = ManifestCache(), _metas()
    m1 = _plan(cache, metas)
    m2 = _plan(cache, list(metas), sync_id="s2", version=2)  # an equal list, not the same object
    assert cache.plans == 1 and m2.buckets is m1.buckets and m2.layout_digest == m1.layout_digest
    assert (m2.sync_id, m2.version, m2.origin) == ("s2", 2, "o") and (m1.sync_id, m1.version) == ("s1", 1)
    assert m1.layout_digest == layout_digest(m1)
    m3 = _plan(cache, metas + [TensorMeta("extra", (2,), torch.bfloat16)], sync_id="s3")
    assert cache.plans == 2 and m3.layout_digest != m1.layout_digest and m3.num_tensors == len(metas) + 1
    m4 = _plan(cache, metas + [TensorMeta("extra", (2,), torch.bfloat16)], sync_id="s4", bucket_bytes=4 << 10)
    assert cache.plans == 3 and m4.layout_digest != m3.layout_digest


def test_full_proto_is_the_plain_encoding_with_the_syncs_fields():
    cache = ManifestCache()
    m = _plan(cache, _metas(), sync_id="s7", version=7)
    assert cache.full_proto(m) == manifest_to_proto(m)
    m8 = _plan(cache, _metas(), sync_id="s8", version=8)
    full8 = cache.full_proto(m8)
    assert (full8.sync_id, full8.version) == ("s8", 8) and full8 == manifest_to_proto(m8)
    assert not compact_proto(m8).buckets and compact_proto(m8).layout_digest == m8.layout_digest


def test_trainer_tracks_who_holds_which_layout():
    cache = ManifestCache()
    e = type("E", (), {"rollout_id": "r", "address": "h:1"})()
    moved = type("E", (), {"rollout_id": "r", "address": "h:2"})()  # same id, new address: a new process
    assert not cache.holds(e, "d1")
    cache.learned(e, "d1")
    assert cache.holds(e, "d1") and not cache.holds(e, "d2") and not cache.holds(moved, "d1") and not cache.holds(e, "")
    cache.forget(e)
    assert not cache.holds(e, "d1")


def test_rollout_resolves_a_digest_only_after_remembering_it_and_checks_it():
    trainer, known = ManifestCache(), KnownLayouts(capacity=2)
    m = _plan(trainer, _metas())
    assert known.manifest_of(compact_proto(m)) is None  # never seen: ask for the full manifest
    full = known.manifest_of(trainer.full_proto(m))
    assert full.layout_digest == m.layout_digest and full.metas() == m.metas()
    assert known.manifest_of(compact_proto(m)) is None  # not remembered until the engine accepted it
    known.remember(full)
    m2 = _plan(trainer, _metas(), sync_id="s2", version=2)
    got = known.manifest_of(compact_proto(m2))
    assert (got.sync_id, got.version, got.origin) == ("s2", 2, "o") and got.buckets == m.buckets
    assert got.layout_digest == m.layout_digest
    # a compact manifest must agree with the layout it names
    bad = compact_proto(m2)
    bad.total_bytes += 4
    with pytest.raises(ValueError, match="manifest.total_bytes=.* differs from the layout"):
        known.manifest_of(bad)
    bad = compact_proto(m2)
    bad.sync_id = ""
    with pytest.raises(ValueError, match="sync_id is empty"):
        known.manifest_of(bad)
    # a full manifest claiming another layout's digest is refused, not remembered under it
    other = _plan(ManifestCache(), _metas(4))
    lying = manifest_to_proto(other)
    lying.layout_digest = m.layout_digest
    with pytest.raises(ValueError, match="does not match its buckets"):
        known.manifest_of(lying)
    # without a digest a full manifest still works (an older trainer) and gets one computed
    plain = manifest_to_proto(
        make_manifest(
            _metas(), version=1, sync_id="p", bucket_bytes=1 << 10, model_family="qwen2", checksum_algo="ws-sum64-v1"
        )
    )
    assert known.manifest_of(plain).layout_digest == m.layout_digest
    assert manifest_from_proto(plain).layout_digest == ""


def test_known_layouts_keep_the_most_recent():
    known = KnownLayouts(capacity=2)
    ms = [_plan(ManifestCache(), _metas(n)) for n in (2, 3, 4)]
    for m in ms:
        known.remember(m)
    assert len(known) == 2
    assert known.manifest_of(compact_proto(ms[0])) is None
    assert known.manifest_of(compact_proto(ms[2])) is not None
    with pytest.raises(ValueError, match="capacity"):
        KnownLayouts(capacity=0)


def test_quantization_is_part_of_the_layout():
    """The same tensors sent as FP8 blocks are read differently by the rollout: another digest, a re-plan,
    and a compact manifest of the bf16 layout cannot stand for the quantized one."""
    from weightsync.bus.plan import Quantization

    metas, fp8 = _metas(), Quantization("fp8", "e4m3", (128, 128))
    plain = make_manifest(metas, version=1, sync_id="a", bucket_bytes=1 << 10)
    quant = make_manifest(metas, version=1, sync_id="a", bucket_bytes=1 << 10, quantization=fp8)
    other_block = make_manifest(
        metas, version=1, sync_id="a", bucket_bytes=1 << 10, quantization=Quantization("fp8", "e4m3", (64, 64))
    )
    assert len({layout_digest(plain), layout_digest(quant), layout_digest(other_block)}) == 3
    cache = ManifestCache()
    p = _plan(cache, metas)
    q = _plan(cache, metas, sync_id="s2", quantization=fp8)
    assert cache.plans == 2 and q.quantization == fp8 and q.layout_digest == layout_digest(q) != p.layout_digest
    known = KnownLayouts()
    full = manifest_from_proto(cache.full_proto(q))
    assert full.quantization == fp8
    full.layout_digest = layout_digest(full)
    known.remember(full)
    held = known.manifest_of(compact_proto(q))
    assert held is not None and held.quantization == fp8
    assert known.manifest_of(compact_proto(p)) is None  # the bf16 layout is not held: the full one is asked for


def test_digest_covers_which_sender_streams_each_bucket():
    """Multi-sender: the same buckets streamed by other ranks are another layout. Each tensor fills
    its own bucket here, so moving t2 from rank 1 to rank 0 changes nothing but bucket 2's sender —
    a rollout holding the old layout would wait for bucket 2 on rank 1's stream while rank 0 sent it."""
    metas, kw = _metas(4), dict(version=1, sync_id="a", bucket_bytes=ALIGN)
    a = make_manifest(metas, owners=[0, 0, 1, 1], **kw)
    b = make_manifest(metas, owners=[0, 0, 0, 1], **kw)
    funnel = make_manifest(metas, **kw)
    slots = [[(s.meta.name, s.offset) for s in x.slots] for x in a.buckets]
    assert (
        slots
        == [[(s.meta.name, s.offset) for s in x.slots] for x in b.buckets]
        == [[(s.meta.name, s.offset) for s in x.slots] for x in funnel.buckets]
    )
    assert [x.sender for x in a.buckets] == [0, 0, 1, 1] and [x.sender for x in b.buckets] == [0, 0, 0, 1]
    assert len({layout_digest(a), layout_digest(b), layout_digest(funnel)}) == 3
    # the rollout computes the same digest from the full manifest it receives (senders on the wire)
    assert layout_digest(manifest_from_proto(manifest_to_proto(a))) == layout_digest(a)


def test_manifest_cache_replans_when_the_senders_change_and_the_rollout_asks_again():
    cache, metas = ManifestCache(), _metas(4)
    multi = _plan(cache, metas, bucket_bytes=ALIGN, owners=[0, 0, 1, 1])
    assert cache.plans == 1 and [b.sender for b in multi.buckets] == [0, 0, 1, 1]
    assert (
        _plan(cache, metas, sync_id="s2", bucket_bytes=ALIGN, owners=[0, 0, 1, 1]).layout_digest == multi.layout_digest
    )
    assert cache.plans == 1
    funnel = _plan(cache, metas, sync_id="s3", bucket_bytes=ALIGN)  # senders=rank0 for this sync
    assert cache.plans == 2 and funnel.senders == [0] and funnel.layout_digest != multi.layout_digest
    # a rollout that validated the multi-sender layout does not take the funnel's by digest
    known = KnownLayouts()
    held = known.manifest_of(manifest_to_proto(multi))
    known.remember(held)
    assert known.manifest_of(compact_proto(multi)).senders == [0, 1]
    assert known.manifest_of(compact_proto(funnel)) is None  # manifest_needed: the full one follows
