import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.pack import alloc_buffer, pack_bucket, unpack_bucket
from weightsync.bus.plan import ALIGN, TensorMeta, make_manifest, manifest_from_proto, manifest_to_proto
from weightsync.v1 import bus_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        shape = (3 + i, 5)
        if dt.is_floating_point:
            out[f"t{i}"] = torch.randn(shape, generator=g).to(dt)
        elif dt == torch.bool:
            out[f"t{i}"] = torch.rand(shape, generator=g) > 0.5
        else:
            out[f"t{i}"] = torch.randint(-100, 100, shape, generator=g).to(dt)
    out["big"] = torch.randn(64, 64, generator=g)  # 16 KiB: larger than the bucket below
    out["scalar"] = torch.tensor(3.5)
    return out


def test_round_trip_is_exact_for_every_dtype_and_oversized_tensor():
    ts = _tensors()
    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()]
    m = make_manifest(metas, version=7, sync_id="s", bucket_bytes=1024)
    big = [b for b in m.buckets if any(s.meta.name == "big" for s in b.slots)]
    assert len(big) == 1 and len(big[0].slots) == 1, "an oversized tensor travels alone"
    m2 = manifest_from_proto(manifest_to_proto(m))
    assert [s.meta for b in m2.buckets for s in b.slots] == metas
    got = {}
    for b in m2.buckets:
        buf = alloc_buffer(max(x.nbytes for x in m2.buckets))
        pack_bucket(b, [(s.meta.name, ts[s.meta.name]) for s in b.slots], buf)
        for n, v in unpack_bucket(b, buf):
            got[n] = v.clone()
    assert got.keys() == ts.keys()
    for n in ts:
        assert got[n].dtype == ts[n].dtype and torch.equal(got[n], ts[n]), n


def test_offsets_are_aligned_and_buckets_respect_size():
    metas = [TensorMeta(f"w{i}", (10 + i,), torch.float32) for i in range(50)]
    m = make_manifest(metas, version=1, sync_id="s", bucket_bytes=512)
    for b in m.buckets:
        assert b.nbytes <= 512 or len(b.slots) == 1
        assert all(s.offset % ALIGN == 0 for s in b.slots)
    assert [s.meta.name for b in m.buckets for s in b.slots] == [x.name for x in metas]


def test_a_pack_is_the_same_bytes_whatever_the_buffer_held():
    """The alignment gaps travel and are checksummed: a delta sync diffs a stream against an
    earlier pack of the same tensors, so stale bytes in a reused buffer must not show through."""
    ts = _tensors()
    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()]
    m = make_manifest(metas, version=1, sync_id="s", bucket_bytes=1024)
    assert any(b.nbytes > sum(s.meta.nbytes for s in b.slots) for b in m.buckets), "the layout has gaps"
    for b in m.buckets:
        items = [(s.meta.name, ts[s.meta.name]) for s in b.slots]
        packs = [pack_bucket(b, items, torch.full((b.nbytes,), fill, dtype=torch.uint8)) for fill in (0x00, 0xA5)]
        assert torch.equal(packs[0], packs[1]), b.index
        assert bucket_checksum(packs[0]) == bucket_checksum(packs[1])


def test_pack_rejects_exporter_that_disagrees_with_plan():
    m = make_manifest([TensorMeta("a", (2, 2), torch.float32)], version=1, sync_id="s", bucket_bytes=1 << 20)
    buf = alloc_buffer(m.buckets[0].nbytes)
    with pytest.raises(ValueError, match="plan expects a"):
        pack_bucket(m.buckets[0], [("a", torch.zeros(3, 2))], buf)
    with pytest.raises(ValueError, match="ended before tensor a"):
        pack_bucket(m.buckets[0], [], buf)


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="exported twice"):
        make_manifest([TensorMeta("a", (1,), torch.float32)] * 2, version=1, sync_id="s", bucket_bytes=1 << 20)


def _good_proto():
    m = make_manifest(
        [TensorMeta("a", (4,), torch.float32), TensorMeta("b", (2, 3), torch.bfloat16)],
        version=3,
        sync_id="s1",
        bucket_bytes=1 << 20,
    )
    return manifest_to_proto(m)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p: setattr(p.buckets[0].tensors[0], "nbytes", 99), "nbytes=99"),
        (lambda p: setattr(p.buckets[0].tensors[1], "offset", 0), "overlaps"),
        (lambda p: setattr(p.buckets[0].tensors[1], "name", "a"), "empty or repeated"),
        (lambda p: setattr(p.buckets[0], "nbytes", 8), "past the bucket"),
        (lambda p: setattr(p.buckets[0].tensors[0], "dtype", 999), "unknown wire dtype"),
        (lambda p: setattr(p, "sync_id", ""), "sync_id is empty"),
        (lambda p: setattr(p, "total_bytes", 1 << 50), "exceeds the limit"),
        (lambda p: setattr(p.buckets[0], "index", 5), "index=5"),
    ],
)
def test_manifest_validation_names_the_field(mutate, match):
    p = _good_proto()
    mutate(p)
    with pytest.raises(ValueError, match=match):
        manifest_from_proto(p)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_fuzzed_manifest_bytes_never_crash_validation(data):
    try:
        msg = bus_pb2.Manifest.FromString(data)
    except Exception:
        return  # not a protobuf at all: rejected by the gRPC layer before us
    try:
        m = manifest_from_proto(msg)
    except ValueError:
        return
    for b in m.buckets:  # whatever passes must be internally consistent
        assert all(s.offset + s.meta.nbytes <= b.nbytes for s in b.slots)


def test_checksum_sees_single_bit_flip_and_length():
    buf = torch.randint(0, 256, (4099,), dtype=torch.uint8)
    c = bucket_checksum(buf)
    flipped = buf.clone()
    flipped[1234] ^= 1
    assert bucket_checksum(flipped) != c
    tail = buf.clone()
    tail[-1] ^= 0x80
    assert bucket_checksum(tail) != c
    padded = torch.cat([buf, torch.zeros(4, dtype=torch.uint8)])
    assert bucket_checksum(padded) != c
    assert bucket_checksum(buf.clone()) == c
