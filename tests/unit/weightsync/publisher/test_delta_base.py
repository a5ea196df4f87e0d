"""The trainer's delta base: checksums summed from the changed words equal a full pass, sync after sync;
what is offered and kept follows the encoding, the transport and the bound."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.checksum import bucket_checksum
from weightsync.bus.layout import ManifestCache
from weightsync.bus.plan import TensorMeta
from weightsync.publisher.delta_sync import DeltaBase

METAS = [TensorMeta("w", (300, 256), torch.bfloat16), TensorMeta("s", (7,), torch.float8_e4m3fn)]


def _manifest(cache: ManifestCache, version: int):
    return cache.manifest(METAS, version=version, sync_id=f"v{version}", bucket_bytes=64 << 10, origin="o")


def _stream(base: DeltaBase, manifest, buckets: list[torch.Tensor], accepted=()):
    """What the delta channel does for each bucket: (payloads, checksums)."""
    s = base.begin(manifest, "tcp")
    s.accepted |= set(accepted)
    payloads = []
    for plan, buf in zip(manifest.buckets, buckets):
        payload, csum, kept = s.encode(plan, buf)
        payloads.append(payload)
        s.store(plan, buf, kept, csum)
    s.finish(True)
    return s, payloads


def test_summed_checksums_equal_a_full_pass_and_deltas_only_where_accepted():
    cache, base, g = ManifestCache(), DeltaBase("delta", 1 << 30, "o"), torch.Generator().manual_seed(0)
    m = _manifest(cache, 1)
    buckets = [torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=g) for p in m.buckets]
    s, payloads = _stream(base, m, buckets)
    assert s.offer is None and payloads == [None] * len(buckets)  # no base yet
    assert s.checksums == [bucket_checksum(b) for b in buckets] and base.held == (1, m.layout_digest)
    for version in (2, 3, 4):
        for b in buckets:  # 2 % of the bytes change (some of them back to what they were)
            pos = torch.randperm(b.numel(), generator=g)[: b.numel() // 50]
            b[pos] = torch.randint(0, 256, (pos.numel(),), dtype=torch.uint8, generator=g)
        m = _manifest(cache, version)
        s, payloads = _stream(base, m, buckets, accepted={"r"} if version != 3 else ())
        assert s.offer is not None and s.offer.version == version - 1 and s.offer.origin == "o"
        assert s.checksums == [bucket_checksum(b) for b in buckets], version
        assert all(torch.equal(base._bufs[p.index], b) for p, b in zip(m.buckets, buckets))  # the next base
        assert (version == 3) == all(p is None for p in payloads)
        assert base.held == (version, m.layout_digest) and base.held_bytes() == sum(b.numel() for b in buckets)


def test_encoding_transport_and_bound_decide_what_is_kept():
    cache = ManifestCache()
    m = _manifest(cache, 1)
    assert not DeltaBase("full").begin(m, "tcp").keep
    assert not DeltaBase("auto").begin(m, "ipc").keep
    # nccl: auto stays full (the GPU compare is slower than the link); delta forces it
    assert not DeltaBase("auto").begin(m, "nccl").keep
    assert DeltaBase("delta").begin(m, "nccl").keep
    assert not DeltaBase("auto", limit_bytes=m.total_bytes - 1).begin(m, "tcp").keep
    assert DeltaBase("auto").begin(m, "tcp").keep
    with pytest.raises(ValueError, match="sync_encoding=delta is carried by tcp, nccl only"):
        DeltaBase("delta").begin(m, "ipc")
    with pytest.raises(ValueError, match="must be full, delta or auto"):
        DeltaBase("sometimes")
    # a failed stream, or a rollout sent in full that did not commit, leaves no base
    base = DeltaBase("auto")
    s = base.begin(m, "tcp")
    s.finish(False)
    assert base.held is None
    s = base.begin(m, "tcp")
    for plan in m.buckets:
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        _, csum, kept = s.encode(plan, buf)
        s.store(plan, buf, kept, csum)
    s.finish(True)
    assert base.held is not None
    s.commit_failed()
    assert base.held is None and base.held_bytes() == 0


def test_the_base_is_named_by_the_syncs_that_streamed_exactly_its_bytes():
    """Several syncs may stream one version (a catch-up per rollout): the offer names each whose
    stream was the base's bytes; a stream that changed any byte names only itself."""
    cache, base, g = ManifestCache(), DeltaBase("delta", 1 << 30, "o"), torch.Generator().manual_seed(0)
    buckets = [torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=g) for p in _manifest(cache, 1).buckets]

    def stream(sync_id: str):
        m = cache.manifest(METAS, version=1, sync_id=sync_id, bucket_bytes=64 << 10, origin="o")
        return _stream(base, m, [b.clone() for b in buckets])[0]

    assert stream("a").offer is None and base.streams == ("a",)
    assert list(stream("b").offer.sync_ids) == ["a"] and base.streams == ("a", "b")  # the same bytes again
    buckets[-1][5] ^= 0x40  # one byte differs: the same version is not the same base
    assert list(stream("c").offer.sync_ids) == ["a", "b"] and base.streams == ("c",)
    assert list(stream("d").offer.sync_ids) == ["c"] and base.streams == ("c", "d")
    for i in range(100):  # bounded
        stream(f"e{i}")
    assert len(base.streams) == 64 and base.streams[-1] == "e99"
    base.drop()
    assert base.streams == () and base.held is None
