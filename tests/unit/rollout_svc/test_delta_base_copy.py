"""The rollout's copy of its delta base: a superseded sync's receiver never writes into the next sync's copy."""

from __future__ import annotations

import threading

import torch

from rollout_svc.sync.delta_base import DeltaBase
from weightsync.bus.layout import ManifestCache
from weightsync.bus.plan import TensorMeta


class _Stalled:
    """A received bucket whose bytes are read only once the test says so (`go`)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.inside, self.go = t, threading.Event(), threading.Event()

    def __getitem__(self, key):
        self.inside.set()
        assert self.go.wait(10)
        return self.t[key]


def test_a_superseded_receiver_never_writes_into_the_next_syncs_copy():
    cache = ManifestCache()
    m1, m2 = (
        cache.manifest([TensorMeta("w", (64,), torch.bfloat16)], version=1, sync_id=s, bucket_bytes=1 << 20)
        for s in ("s1", "s2")
    )
    (plan,) = m1.buckets
    base = DeltaBase()
    base.prepared(m1, None, 0, "", False)
    old = base.for_sync("s1")
    late = _Stalled(torch.ones(plan.nbytes, dtype=torch.uint8))
    errors: list[Exception] = []

    def receive_late():  # s1's receiver, still reading its bucket when s2 is prepared
        try:
            old.received(plan, late)
        except Exception as exc:  # superseded: refused, which is as good
            errors.append(exc)

    def next_sync():
        base.prepared(m2, None, 0, "", False)
        base.for_sync("s2").received(m2.buckets[0], torch.full((plan.nbytes,), 2, dtype=torch.uint8))
        base.committed(m2)

    a = threading.Thread(target=receive_late)
    a.start()
    assert late.inside.wait(10)
    b = threading.Thread(target=next_sync)
    b.start()
    b.join(timeout=0.5)  # whether it waits for s1's write or not, the copy must end as s2's
    late.go.set()
    a.join(10)
    b.join(10)
    assert not a.is_alive() and not b.is_alive()
    assert base.held is not None and base.held_sync == "s2"
    assert torch.equal(base._bufs[plan.index], torch.full((plan.nbytes,), 2, dtype=torch.uint8)), errors
