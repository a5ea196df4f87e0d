import pytest
import torch

from weightsync.bus.channel import BucketSender
from weightsync.bus.errors import TransportError
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import TensorMeta, make_manifest


class CollectingSender(BucketSender):
    def __init__(self, fail_at=None):
        self.buckets, self.fail_at = [], fail_at

    def send(self, plan, buf, checksum):
        if plan.index == self.fail_at:
            raise TransportError("link down")
        self.buckets.append((plan.index, buf.clone(), checksum))

    def failures(self):
        return {}

    def close(self):
        pass


def _setup(n=10):
    ts = {f"w{i}": torch.full((100,), float(i)) for i in range(n)}
    m = make_manifest(
        [TensorMeta(k, tuple(v.shape), v.dtype) for k, v in ts.items()], version=1, sync_id="p", bucket_bytes=1024
    )
    return ts, m


def test_every_bucket_sent_in_order_with_reused_buffers():
    ts, m = _setup()
    s = CollectingSender()
    stats = stream_buckets(m, iter(ts.items()), s, num_buffers=2)
    assert [i for i, _, _ in s.buckets] == list(range(len(m.buckets)))
    assert stats.peak_buffer_bytes == 2 * max(b.nbytes for b in m.buckets)
    first = s.buckets[0][1][:400].view(torch.float32)
    assert torch.equal(first, ts["w0"])


def test_exporter_error_surfaces():
    ts, m = _setup()
    bad = list(ts.items())
    bad[3] = ("wrong", bad[3][1])
    with pytest.raises(ValueError, match="plan expects w3"):
        stream_buckets(m, iter(bad), CollectingSender())


def test_extra_tensor_from_exporter_is_an_error():
    ts, m = _setup()
    items = list(ts.items()) + [("extra", torch.zeros(1))]
    with pytest.raises(ValueError, match="beyond the manifest"):
        stream_buckets(m, iter(items), CollectingSender())


def test_transport_error_propagates():
    ts, m = _setup()
    with pytest.raises(TransportError, match="link down"):
        stream_buckets(m, iter(ts.items()), CollectingSender(fail_at=2))


def test_slow_exporter_hits_timeout():
    import time

    ts, m = _setup()

    def slow():
        for kv in ts.items():
            time.sleep(0.5)
            yield kv

    with pytest.raises(TimeoutError):
        stream_buckets(m, slow(), CollectingSender(), timeout=0.3)


def test_oversized_tensor_travels_from_its_own_memory():
    big = torch.arange(4096, dtype=torch.float32)  # 16 KiB > 1 KiB buckets
    ts = {"a": torch.ones(10), "big": big, "b": torch.zeros(10)}
    m = make_manifest(
        [TensorMeta(k, tuple(v.shape), v.dtype) for k, v in ts.items()], version=1, sync_id="z", bucket_bytes=1024
    )
    seen = {}

    class PtrSender(CollectingSender):
        def send(self, plan, buf, checksum):
            seen[plan.index] = buf.data_ptr()
            super().send(plan, buf, checksum)

    s = PtrSender()
    stats = stream_buckets(m, iter(ts.items()), s)
    big_bucket = next(b.index for b in m.buckets if b.slots[0].meta.name == "big")
    assert seen[big_bucket] == big.data_ptr(), "oversized tensor was copied"
    assert stats.peak_buffer_bytes < big.numel() * 4
    assert torch.equal(s.buckets[big_bucket][1].view(torch.float32), big)


def test_async_sender_gets_each_buffer_back_only_after_the_next_send():
    ts, m = _setup(n=20)
    log = []

    class AsyncSender(CollectingSender):
        releases_previous = True

        def send(self, plan, buf, checksum):
            log.append(("send", plan.index, buf.data_ptr()))
            super().send(plan, buf, checksum)

        def flush(self):
            log.append(("flush",))

    stream_buckets(m, iter(ts.items()), AsyncSender(), num_buffers=2)
    sends = [e for e in log if e[0] == "send"]
    # consecutive buckets never share a buffer: k's buffer is still "on the wire" during send(k+1)
    assert all(a[2] != b[2] for a, b in zip(sends, sends[1:]))
    assert log[-1] == ("flush",)


def test_buffer_pool_keeps_its_buffers_across_syncs_and_regrows_when_too_small():
    from weightsync.bus.pipeline import BufferPool

    ts, m = _setup()
    pool = BufferPool()
    for _ in range(2):
        stream_buckets(m, iter(ts.items()), CollectingSender(), buffers=pool)
    assert pool.allocations == 1 and len(pool.buffers) == 2
    kept = [b.data_ptr() for b in pool.buffers]
    stream_buckets(m, iter(ts.items()), CollectingSender(), buffers=pool)
    assert [b.data_ptr() for b in pool.buffers] == kept
    big = {f"w{i}": torch.full((200,), float(i)) for i in range(4)}
    m2 = make_manifest(
        [TensorMeta(k, tuple(v.shape), v.dtype) for k, v in big.items()], version=1, sync_id="q", bucket_bytes=2048
    )
    s = CollectingSender()
    stream_buckets(m2, iter(big.items()), s, buffers=pool)
    assert pool.allocations == 2 and all(b.numel() >= m2.buckets[0].nbytes for b in pool.buffers)
    assert torch.equal(s.buckets[0][1][:800].view(torch.float32), big["w0"])


def test_in_place_buckets_are_sent_as_they_are_checksummed_as_they_are():
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.pack import pack_bucket, unpack_bucket

    ts, m = _setup()
    packed = CollectingSender()
    stream_buckets(m, iter(ts.items()), packed)
    flats = []
    for plan in m.buckets:
        flat = torch.zeros(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, ((s.meta.name, ts[s.meta.name]) for s in plan.slots), flat)
        flats.append(flat)
    s = CollectingSender()

    def no_export():
        raise AssertionError("the exporter must not run when the buckets are in place")
        yield

    in_place = stream_buckets(m, no_export(), s, in_place=flats)
    assert in_place.checksums == [bucket_checksum(f) for f in flats] and in_place.peak_buffer_bytes == 0
    assert [i for i, _, _ in s.buckets] == [i for i, _, _ in packed.buckets]
    for plan, (_, a, _), (_, b, _) in zip(m.buckets, s.buckets, packed.buckets):  # same tensors (padding aside)
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(unpack_bucket(plan, a), unpack_bucket(plan, b)))
    with pytest.raises(ValueError, match=r"in_place has 1 buffers for the manifest's \d+ buckets"):
        stream_buckets(m, iter(()), CollectingSender(), in_place=flats[:1])
    with pytest.raises(ValueError, match=r"in_place\[0\]: need a flat uint8 buffer"):
        stream_buckets(m, iter(()), CollectingSender(), in_place=[f.view(torch.int32) for f in flats])


def _flats(ts, m):
    from weightsync.bus.pack import pack_bucket

    flats = []
    for plan in m.buckets:
        flat = torch.zeros(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, ((s.meta.name, ts[s.meta.name]) for s in plan.slots), flat)
        flats.append(flat)
    return flats


@pytest.mark.parametrize("in_band, carried", [("all", "every"), ("first", "first"), ("none", "no")])
def test_in_place_checksums_travel_in_band_only_where_the_sender_carries_them_and_all_reach_the_commit(
    in_band, carried
):
    from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum

    ts, m = _setup()
    flats = _flats(ts, m)
    want = [bucket_checksum(f) for f in flats]
    s = CollectingSender()
    s.checksums_in_band = in_band
    started = InFlightChecksums(flats)  # as the attempt starts them before PrepareSync
    stats = stream_buckets(m, iter(()), s, in_place=flats, in_place_checksums=started)
    assert stats.checksums == want  # what CommitSync carries, whichever went in band
    sent = [c for _, _, c in s.buckets]
    expect = {"every": want, "first": [want[0]] + [None] * (len(want) - 1), "no": [None] * len(want)}[carried]
    assert sent == expect and len(m.buckets) > 2


def test_a_sender_naming_an_unknown_checksums_in_band_is_refused_and_a_short_checksum_list_too():
    from weightsync.bus.copy.checksum import InFlightChecksums

    ts, m = _setup()
    flats = _flats(ts, m)
    s = CollectingSender()
    s.checksums_in_band = "some"
    with pytest.raises(ValueError, match="sender.checksums_in_band='some' must be all, first or none"):
        stream_buckets(m, iter(()), s, in_place=flats)
    with pytest.raises(ValueError, match=r"in_place_checksums has 1 for the manifest's \d+ buckets"):
        stream_buckets(m, iter(()), CollectingSender(), in_place=flats, in_place_checksums=InFlightChecksums(flats[:1]))


def test_an_in_place_buffer_of_the_buckets_exact_size_is_its_own_view_a_longer_one_is_cut_to_it():
    from weightsync.bus.pipeline import in_place_views

    _, m = _setup()
    exact = [torch.zeros(plan.nbytes, dtype=torch.uint8) for plan in m.buckets]
    longer = [torch.zeros(plan.nbytes + 64, dtype=torch.uint8) for plan in m.buckets]
    assert all(v is b for v, b in zip(in_place_views(m, exact), exact))  # no slice per bucket per sync
    for plan, v, b in zip(m.buckets, in_place_views(m, longer), longer):
        assert v.numel() == plan.nbytes and v.data_ptr() == b.data_ptr()
