"""The trainer writes into an engine whose parameters live in another process (SGLang: it exports a ready-made
destination table, rollout_svc/engine/sglang_export.py), through the real services on a CPU.

The rollout's built-in engine plays SGLang's part at the engine boundary: it offers no parameters
(`writable_params` is None), declares `exports_destinations`, and hands a table only once a sync has
gone through its loader (as SGLang's worker learns its slot tables); every sync's begin_apply (SGLang: pause) and
end_apply (SGLang: flush the radix cache, continue) are recorded. Only the GPU boundary is faked otherwise
(tests/support/fake_gpu.py)."""

from __future__ import annotations

import pytest

from tests.support.fake_gpu import FakeGpu, fake_gpu_boundary
from tests.support.fleet_sync import assert_serves_export, bump_weights
from tests.support.local_apps import local_fleet
from weightsync.bus.ipc.trainer_writes import offer, slot_metas
from weightsync.v1 import rollout_pb2, trainer_pb2


class SglangLike:
    """What SglangEngine's export does, over the built-in engine of `app`."""

    def __init__(self, app, gpu: FakeGpu):
        eng, self.events, self.learnt, self.offered = app.engine, [], False, 0
        self.tables: dict = {}
        begin, end, load = eng.begin_apply, eng.end_apply, eng.load_bucket

        def load_bucket(plan, buf):
            self.events.append("load")
            load(plan, buf)

        def end_apply():
            self.learnt = self.learnt or "load" in self.events
            self.events.append("end")
            end()

        def ipc_destinations(manifest):
            if not self.learnt:
                return None
            if manifest.layout_digest not in self.tables:
                params = [eng._target(m.name).data for m in slot_metas(manifest)]
                self.offered += 1
                self.tables[manifest.layout_digest] = (f"sglang-{self.offered}", offer(manifest, params, gpu.share))
            return self.tables[manifest.layout_digest]

        eng.exports_destinations = True
        # SGLang's parameters are not in this process: no `writable_params` (the base's None)
        eng.writable_params, eng.load_bucket, eng.ipc_destinations = lambda metas: None, load_bucket, ipc_destinations
        eng.begin_apply = lambda: (self.events.append("begin"), begin())[1]
        eng.end_apply = end_apply


@pytest.fixture(scope="module")
def pair():
    gpu = FakeGpu()
    with local_fleet({"s": {"apply_mode": "inplace"}}, "tok") as (trainer, rollouts, stub):
        fake_gpu_boundary(trainer, rollouts["s"], gpu)
        trainer.orch.bucket_bytes = 64 << 10  # several buckets
        yield trainer, rollouts["s"], stub, SglangLike(rollouts["s"], gpu)


def _sync(stub):
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert report.ok, [r.error for r in report.rollouts]
    return report


def test_the_first_sync_reads_and_learns_the_later_ones_are_written_by_the_trainer_paused_and_flushed(pair):
    trainer, app, stub, sgl = pair
    routes = []
    for _ in range(3):
        bump_weights(trainer)
        sgl.events.clear()
        report = _sync(stub)
        routes.append(report.route.split("/")[1])
        assert_serves_export(trainer, app)
        if routes[-1] == "trainer_writes":
            assert sgl.events == ["begin", "end"], sgl.events  # paused, no bucket loaded here, flushed at commit
        else:
            assert sgl.events[0] == "begin" and sgl.events[-1] == "end" and "load" in sgl.events
    assert routes == ["rollout_reads", "trainer_writes", "trainer_writes"], routes
    assert sgl.offered == 1  # one table for the layout, named by id afterwards


def test_a_table_the_trainer_refuses_fails_the_sync_stale_and_the_next_heals(pair):
    trainer, app, stub, sgl = pair
    bump_weights(trainer)
    _sync(stub)
    ((digest, (table_id, table)),) = sgl.tables.items()
    bad = type(table)()
    bad.CopyFrom(table)
    del bad.tensors[-1]  # a tensor of the manifest without a destination
    sgl.tables[digest] = ("sglang-bad", bad)
    bump_weights(trainer)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert not report.ok
    (r,) = report.rollouts
    assert f"tensor {table.tensors[-1].name}: the rollout's destination table lacks it" in r.error, r.error
    assert app.tx.state == rollout_pb2.STALE  # paused for the writes at prepare: never serves a half-written model
    sgl.tables[digest] = (table_id, table)
    _sync(stub)
    assert_serves_export(trainer, app)
