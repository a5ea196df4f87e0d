"""The trainer's end of NCCL: the communicator cache keyed by membership, with a fake bus."""

import pytest
import torch

from weightsync.bus.nccl.sender import NcclGroupCache


class _Group:
    def __init__(self, world):
        self.world, self.aborted, self.healthy = world, "", True

    def abort(self, reason):
        self.aborted, self.healthy = reason, False


class _Bus:
    needs_cuda = False

    def __init__(self):
        self.ids = 0
        self.opened = []

    def new_unique_id(self):
        self.ids += 1
        return bytes([self.ids]) * 128

    def open_group(self, uid, world, rank, device, timeout):
        assert rank == 0
        g = _Group(world)
        self.opened.append(g)
        return g


def test_group_cache_is_keyed_by_membership_and_rebuilt_after_a_failure():
    bus = _Bus()
    cache = NcclGroupCache(bus, torch.device("cpu"))
    p1 = cache.plan([("b", "h:2"), ("a", "h:1")])
    assert p1.fresh and p1.world_size == 3 and (p1.rank_of("a"), p1.rank_of("b")) == (1, 2)
    g1 = cache.join(p1, timeout=5)
    p2 = cache.plan([("a", "h:1"), ("b", "h:2")])
    assert not p2.fresh and p2.unique_id == p1.unique_id and p2.group_id == p1.group_id
    assert cache.join(p2, timeout=5) is g1 and cache.builds == 1
    # the same id at another address is another member (the pod was replaced)
    p3 = cache.plan([("a", "h:9"), ("b", "h:2")])
    assert p3.fresh and p3.unique_id != p1.unique_id and g1.aborted == "membership changed"
    g3 = cache.join(p3, timeout=5)
    g3.abort("NCCL error 6")
    p4 = cache.plan([("a", "h:9"), ("b", "h:2")])
    assert p4.fresh and p4.group_id != p3.group_id
    cache.join(p4, timeout=5)
    cache.invalidate("sync failed")
    assert cache.plan([("a", "h:9"), ("b", "h:2")]).fresh and cache.builds == 3
    with pytest.raises(KeyError, match="not a member"):
        p4.rank_of("zz")
