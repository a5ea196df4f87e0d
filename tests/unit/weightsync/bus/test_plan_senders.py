"""Bucket layouts with several senders: each bucket belongs to exactly one trainer rank, computed
from metadata alone, identically on every rank; the sender survives the wire and is validated."""

import pytest
import torch

from weightsync.bus.plan import MAX_SENDERS, TensorMeta, make_manifest, manifest_from_proto, manifest_to_proto


def _metas(n=12):
    return [TensorMeta(f"t{i}", (16, 8 + i), torch.float32) for i in range(n)]


def test_each_owner_gets_its_own_buckets_in_its_order_and_ranks_ascend():
    metas = _metas()
    owners = [2, 0, 0, 2, 1, 0, 2, 1, 1, 0, 2, 2]
    m = make_manifest(metas, version=3, sync_id="s", bucket_bytes=1200, owners=owners)
    assert [b.index for b in m.buckets] == list(range(len(m.buckets)))
    assert m.senders == [0, 1, 2]
    # ranks follow each other: all of rank 0's buckets, then rank 1's, then rank 2's
    assert [b.sender for b in m.buckets] == sorted(b.sender for b in m.buckets)
    for rank in (0, 1, 2):
        mine = [s.meta.name for b in m.buckets_of(rank) for s in b.slots]
        assert mine == [mt.name for mt, o in zip(metas, owners) if o == rank]
        for b in m.buckets_of(rank):  # a bucket never mixes owners and stays within its size
            assert b.nbytes <= 1200 or len(b.slots) == 1
    assert sorted(s.meta.name for b in m.buckets for s in b.slots) == sorted(mt.name for mt in metas)
    assert sum(b.tensor_bytes for b in m.buckets) == sum(mt.nbytes for mt in metas)


def test_one_owner_is_the_single_sender_layout():
    metas = _metas()
    a = make_manifest(metas, version=1, sync_id="s", bucket_bytes=1200)
    b = make_manifest(metas, version=1, sync_id="s", bucket_bytes=1200, owners=[0] * len(metas))
    assert a.digest() == b.digest() and a.senders == [0]


def test_digest_is_deterministic_and_sees_every_layout_change():
    metas, owners = _metas(), [0] * 6 + [1] * 6
    kw = dict(version=1, sync_id="s", bucket_bytes=1200)
    d = make_manifest(metas, owners=owners, **kw).digest()
    assert d == make_manifest(list(metas), owners=list(owners), **kw).digest()
    assert d != make_manifest(metas, owners=[0] * 5 + [1] * 7, **kw).digest()
    assert d != make_manifest(metas, owners=owners, **{**kw, "bucket_bytes": 2400}).digest()
    assert d != make_manifest(metas, owners=owners, **{**kw, "sync_id": "t"}).digest()
    other = metas[:-1] + [TensorMeta("t11", (16, 19), torch.bfloat16)]
    assert d != make_manifest(other, owners=owners, **kw).digest()


def test_sender_round_trips_through_the_proto_and_is_validated():
    m = make_manifest(_metas(), version=1, sync_id="s", bucket_bytes=1200, owners=[0] * 4 + [3] * 8)
    back = manifest_from_proto(manifest_to_proto(m))
    assert [b.sender for b in back.buckets] == [b.sender for b in m.buckets] and back.senders == [0, 3]
    assert back.digest() == m.digest()
    pb = manifest_to_proto(m)
    pb.buckets[-1].sender = MAX_SENDERS
    with pytest.raises(ValueError, match=r"manifest.buckets\[\d+\].sender"):
        manifest_from_proto(pb)


def test_bad_owner_lists_are_refused():
    with pytest.raises(ValueError, match="owners has 2 entries for 12 tensors"):
        make_manifest(_metas(), version=1, sync_id="s", bucket_bytes=1200, owners=[0, 1])
    with pytest.raises(ValueError, match="owner rank -1"):
        make_manifest(_metas(), version=1, sync_id="s", bucket_bytes=1200, owners=[-1] * 12)
