"""PrefixCache alone: LRU by entries and bytes, private copies, flush epochs."""

from __future__ import annotations

import torch

from rollout_svc.engine.prefix_cache import PrefixCache, cache_nbytes


def kv(seq: int):
    from transformers import DynamicCache

    c = DynamicCache()
    c.update(torch.ones(1, 2, seq, 4), torch.ones(1, 2, seq, 4), 0)
    return c


def test_lru_by_entries_and_bytes():
    c = PrefixCache(max_entries=2)
    for p in ([1], [2], [3]):
        c.put(p, kv(3), torch.zeros(8), epoch=0)
    assert c.get([1]) is None and c.get([2]) is not None and len(c) == 2
    c.put([4], kv(3), torch.zeros(8), epoch=0)  # [2] was used last, so [3] goes
    assert c.get([3]) is None and c.get([2]) is not None

    per = cache_nbytes(kv(3)) + 8 * 4
    assert per == 2 * 2 * 3 * 4 * 4 + 32
    b = PrefixCache(max_entries=10, max_bytes=2 * per)
    for p in ([1], [2], [3]):
        b.put(p, kv(3), torch.zeros(8), epoch=0)
    assert len(b) == 2 and b.nbytes == 2 * per and b.get([1]) is None
    assert not b.put([9], kv(100), torch.zeros(8), epoch=0)  # larger than the whole budget


def test_get_returns_a_private_copy():
    c = PrefixCache(4)
    c.put([1, 2], kv(2), torch.zeros(8), epoch=0)
    e = c.get([1, 2])
    e.cache.batch_repeat_interleave(3)
    e.cache.update(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4), 0)
    again = c.get([1, 2])
    assert again.cache.layers[0].keys.shape == (1, 2, 2, 4)


def test_flush_voids_prefills_begun_before_it():
    c = PrefixCache(4)
    epoch = c.epoch
    c.flush()
    assert not c.put([1], kv(1), torch.zeros(8), epoch=epoch) and len(c) == 0
    assert c.put([1], kv(1), torch.zeros(8), epoch=c.epoch) and len(c) == 1
    c.flush()
    assert len(c) == 0 and c.nbytes == 0 and c.get([1]) is None
