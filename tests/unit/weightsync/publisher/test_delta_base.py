"""The trainer's delta base: checksums summed from the changed words equal a full pass, sync after sync;
what is offered and kept follows the encoding, the transport and the bound."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.copy.checksum import bucket_checksum
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


def _full_nccl_sync(base: DeltaBase, m, buckets, rate: float, accepted=(), fresh: bool = False):
    """One nccl sync under `base`: its buckets through the channel's steps, then its stream measured at
    `rate` bytes/s (a one-second stream of that many bytes). Returns its DeltaStream."""
    s = base.begin(m, "nccl")
    s.broadcast_to(accepted or {"r"})  # a broadcast: deltas only when every target accepted
    if s.offer is not None:
        s.accepted |= set(accepted)
    for plan, buf in zip(m.buckets, buckets):
        if s.keep:
            _, csum, kept = s.encode(plan, buf)
            s.store(plan, buf, kept, csum)
    s.finish(True)
    s.streamed(int(rate), 1.0, fresh)
    return s


def test_auto_on_nccl_keeps_a_base_once_a_full_sync_measured_a_slow_link():
    """auto on nccl: full, with no base, until a full sync measured the link below delta_link_gbps; then
    the next sync keeps its base and the one after offers it; a fast measurement drops it again."""
    cache, g = ManifestCache(), torch.Generator().manual_seed(3)
    buckets = [torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=g) for p in _manifest(cache, 1).buckets]
    base = DeltaBase("auto", 1 << 30, "o", link_gbps=400)
    slow, fast = 6e9, 290e9  # bytes/s: NCCL over sockets, NVLink (48 and 2320 Gb/s)
    # no rate yet: full, nothing kept; a stream on a group built in it measures nothing
    s = _full_nccl_sync(base, _manifest(cache, 1), buckets, slow, fresh=True)
    assert not s.keep and base.held is None and base.link_rate is None
    # measured slow: this sync was full and kept nothing (decided at its start) ...
    s = _full_nccl_sync(base, _manifest(cache, 2), buckets, slow)
    assert not s.keep and base.held is None and base.link_rate == slow
    # ... the next keeps its base, unoffered (still full on the wire: it measures too) ...
    s = _full_nccl_sync(base, _manifest(cache, 3), buckets, slow)
    assert s.keep and s.offer is None and base.held == (3, s.manifest.layout_digest) and base.held_bytes() > 0
    # ... and the one after offers it; its delta stream's time is the codec's too: not a measure of the link
    s = _full_nccl_sync(base, _manifest(cache, 4), buckets, fast, accepted={"r"})
    assert s.offer is not None and s.offer.version == 3 and s.accepted == {"r"}
    assert base.link_rate == slow
    # a full sync (the rollout refused the base) measures a fast link: the next goes full and drops the base
    s = _full_nccl_sync(base, _manifest(cache, 5), buckets, fast)
    assert s.keep and not s.accepted and base.link_rate == fast and base.held is not None
    s = _full_nccl_sync(base, _manifest(cache, 6), buckets, fast)
    assert not s.keep and base.held is None and base.held_bytes() == 0
    # a failed stream measures nothing
    s = base.begin(_manifest(cache, 7), "nccl")
    s.finish(False)
    s.streamed(int(slow), 1.0, False)
    assert base.link_rate == fast


def test_delta_link_gbps_zero_disables_and_other_encodings_ignore_the_rate():
    cache = ManifestCache()
    m = _manifest(cache, 1)
    off = DeltaBase("auto", link_gbps=0)
    off.measured(1.0, "s")  # 8 b/s: slower than anything
    assert not off.begin(m, "nccl").keep and off.held is None
    # the knob's edge: a rate at it is fast (full); below it, slow
    edge = DeltaBase("auto", link_gbps=8)  # 1 GB/s
    edge.measured(1e9, "s")
    assert not edge.begin(m, "nccl").keep
    edge.measured(0.99e9, "s")
    assert edge.begin(m, "nccl").keep
    # delta forces, full refuses, tcp and ipc do as before, whatever the rate
    for rate in (1.0, 1e12):
        for enc, transport, keep in (
            ("delta", "nccl", True),
            ("full", "nccl", False),
            ("auto", "tcp", True),
            ("auto", "ipc", False),
        ):
            b = DeltaBase(enc, link_gbps=400)
            b.measured(rate, "s")
            assert b.begin(m, transport).keep == keep, (enc, transport, rate)
    # only nccl streams measure
    b = DeltaBase("auto")
    s = b.begin(m, "tcp")
    s.finish(True)
    s.streamed(1000, 1.0, False)
    assert b.link_rate is None
    with pytest.raises(ValueError, match="delta_link_gbps=-1 must be >= 0"):
        DeltaBase("auto", link_gbps=-1)
