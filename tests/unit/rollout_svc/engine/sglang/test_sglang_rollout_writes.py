"""rollout-svc writes NCCL and TCP buckets into SGLang's parameters itself (rollout_svc/engine/sglang_mapped.py).

Buckets are handed to the sync transaction as the TCP and NCCL receivers hand them (`consume_bucket`, in-place
apply), onto the SGLang adapter over tests/support/fake_sglang.py whose `update_weights_from_tensor` runs our loader
on test_sglang_loader.py's toy model (fused qkv, a padded embedding) in-process, as SGLang's TP worker would. The
table SGLang's worker exports is shared and mapped through a stand-in for CUDA IPC that maps a handle back to the
same storage (test_sglang_export.py's); tests/sglang_exec runs the mapped write against SGLang's model classes.
The last test syncs over TCP through the real services (trainer-svc to rollout-svc) into the same adapter."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_svc.engine import sglang_loader as sl
from rollout_svc.sync.transaction import SyncTransaction
from tests.support.fake_sglang import FakeSglang, adapter_on, scripted
from tests.support.packed import packed_sync
from tests.unit.rollout_svc.engine.sglang.test_sglang_loader import H, Toy
from tests.unit.weightsync.bus.ipc.test_trainer_writes import FakeIpc
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.errors import SyncError
from weightsync.bus.plan import TensorMeta
from weightsync.v1 import rollout_pb2


class ToySglang(FakeSglang):
    """SGLang's Engine whose TP worker runs our loader (every update_weights_from_tensor call) on `model`."""

    def __init__(self, model):
        super().__init__(scripted([1], [-0.1]))
        self.model, self.loads, self.refuse_exports = model, [], False

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert not flush_cache
        if load_format is None:  # SGLang's own path: the model's load_weights
            self.loads.append("update")
            self.model.load_weights(named_tensors)
            return True, "Succeeded"
        assert load_format == sl.LOADER
        first = named_tensors[0][0]
        if self.refuse_exports and first.startswith(sl.EXPORT):
            return False, "refused"
        self.loads.append("export" if first.startswith(sl.EXPORT) else "bucket")
        sl.load(self.model, named_tensors)
        return True, "Succeeded"


pytestmark = pytest.mark.usefixtures("io_struct")  # conftest.py


def _rollout(ipc: FakeIpc, model=None, **opts):
    model = Toy() if model is None else model
    sgl = ToySglang(model)
    eng = adapter_on(sgl, **opts)
    eng._direct_rows, eng.direct_cpu = [torch.zeros(16, sl.RESULT_WORDS, dtype=torch.int64)], True
    eng.open_allocation = ipc.open
    # CPU buffers stand in for CUDA ones: a received bucket goes to our loader, as load_bucket sends a CUDA one
    eng.load_bucket = lambda plan, buf: eng.load_bucket_summed(plan, buf)
    eng._metas = {n: TensorMeta(n, tuple(t.shape), t.dtype) for n, t in _state(0).items()}
    return model, sgl, eng, SyncTransaction(eng, "inplace")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {n: torch.randn(H, H, generator=g).to(torch.bfloat16) for n in "qkv"}
    state["embed"] = torch.randn(10, H, generator=g).to(torch.bfloat16)
    return state


def _sync(tx, version: int, upto: int | None = None):
    """Sync `_state(version)` as version `version` in four buckets; with `upto`, only the buckets before it
    arrive and the sync is aborted."""
    state = _state(version)
    m, bufs = packed_sync(state, version=version, sync_id=f"s{version}", bucket_bytes=256)
    assert len(bufs) == 4
    sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
    tx.prepare(m, timeout=30)
    for i, buf in enumerate(bufs[:upto]):
        tx.consume_bucket(m.sync_id, i, buf, sums[i])
    if upto is not None:
        tx.abort(m.sync_id, "the trainer gave up")
        return state
    tx.commit(m.sync_id, version, sums)
    return state


def _assert_holds(model: Toy, state) -> None:
    assert torch.equal(model.qkv, torch.cat([state["q"], state["k"], state["v"]]))
    assert torch.equal(model.embed[:10], state["embed"])
    assert torch.equal(model.embed[10:], torch.zeros(6, H, dtype=torch.bfloat16))  # as SGLang's loader left them


def test_after_the_learning_sync_rollout_svc_writes_sglangs_parameters_with_no_sglang_call_per_bucket(ipc):
    model, sgl, eng, tx = _rollout(ipc)
    _assert_holds(model, _sync(tx, 1))
    assert sgl.loads == ["bucket"] * 4 + ["export"]  # the first sync learns through the loader, then exports
    assert ipc.opens == 2  # qkv and embed: each exported storage mapped once
    for version in (2, 3):
        sgl.events.clear()
        _assert_holds(model, _sync(tx, version))  # exactly the trainer's tensors, in SGLang's fused layout
        assert sgl.loads == ["bucket"] * 4 + ["export"], "SGLang's loader was called after the first sync"
        assert sgl.events == ["pause", "flush", "continue"], sgl.events  # paused, written, flushed, continued
    assert tx.state == rollout_pb2.SERVING and tx.version == 3
    assert ipc.opens == 2  # not mapped again
    assert not eng.writing_in_place  # nothing is offered outside a sync
    assert eng.writable_params([eng._metas["q"]]) is None
    assert eng.bytes_per_rank(1000) == [1000]


def test_an_abort_after_a_written_bucket_is_stale_and_the_next_sync_heals_without_the_loader(ipc):
    model, sgl, _, tx = _rollout(ipc)
    _sync(tx, 1)
    _sync(tx, 2, upto=1)
    assert tx.state == rollout_pb2.STALE  # a bucket of version 2 is in SGLang's parameters
    assert torch.equal(model.qkv[:H], _state(2)["q"])
    _assert_holds(model, _sync(tx, 3))
    assert tx.state == rollout_pb2.SERVING and sgl.loads.count("bucket") == 4


def test_a_bucket_that_fails_its_check_after_the_write_aborts_the_sync_stale(ipc):
    _, _, _, tx = _rollout(ipc)
    _sync(tx, 1)
    m, bufs = packed_sync(_state(2), version=2, sync_id="s2", bucket_bytes=256)
    tx.prepare(m, timeout=30)
    tx.consume_bucket(m.sync_id, 0, bufs[0], bucket_checksum(bufs[0]))
    with pytest.raises(SyncError, match="checksum"):
        tx.consume_bucket(m.sync_id, 1, bufs[1], bucket_checksum(bufs[1]) ^ 1)  # checked after its write
    tx.abort(m.sync_id, "bucket 1's checksum")  # (the receiver aborts a sync whose bucket failed)
    assert tx.state == rollout_pb2.STALE


@pytest.mark.parametrize(
    "how",
    ["export refused", "table does not fit its mapping", "rollout_writes=False", "memory saver"],
)
def test_without_a_usable_table_every_sync_goes_through_sglangs_loader(ipc, how):
    opts = {"rollout_writes": False} if how == "rollout_writes=False" else {}
    if how == "memory saver":
        opts = {"colocated": True}
    model, sgl, eng, tx = _rollout(ipc, **opts)
    sgl.refuse_exports = how == "export refused"
    if how == "table does not fit its mapping":
        eng.open_allocation = lambda h: ipc.open(h)[:8]  # a mapping shorter than the table's entries
    _sync(tx, 1)
    loads = sgl.loads.count("bucket")
    for version in (2, 3):
        _assert_holds(model, _sync(tx, version))
    assert sgl.loads.count("bucket") == loads + 8, sgl.loads  # every bucket of both syncs through the loader


def test_releasing_sglangs_memory_drops_the_mappings_and_the_next_sync_learns_again(ipc):
    model, sgl, eng, tx = _rollout(ipc)
    _sync(tx, 1)
    assert eng._mapped_views
    eng.release_memory(["weights"])
    eng.resume_memory()
    assert not eng._mapped_views and not eng.__dict__.get("_dest_tables")
    _assert_holds(model, _sync(tx, 2))  # through the loader, which learns and exports again
    _assert_holds(model, _sync(tx, 3))  # mapped again and written by rollout-svc
    assert sgl.loads == (["bucket"] * 4 + ["export"]) * 2 and ipc.opens == 4


def test_the_staged_apply_never_writes_the_mapped_parameters(ipc):
    """The staged apply never pauses SGLang (no begin_apply): nothing is offered to it."""
    model, sgl, eng, tx = _rollout(ipc)
    _sync(tx, 1)
    assert eng._mapped_views
    staged = SyncTransaction(eng, "staged")
    _assert_holds(model, _sync(staged, 2))
    assert sgl.loads[5:] == ["update"]  # SGLang's own loader took the staged tensors (one chunk)


class FlatModel(torch.nn.Module):
    """SGLang's model as far as weights go, for any tensor names: every tensor a region of one flat parameter per
    dtype, as SGLang's fused layers hold several checkpoint tensors in one storage."""

    def __init__(self, metas: dict[str, TensorMeta]):
        super().__init__()
        self.where: dict[str, tuple[str, int]] = {}
        ends: dict[torch.dtype, int] = {}
        for m in metas.values():
            self.where[m.name] = (str(m.dtype).split(".")[-1], ends.get(m.dtype, 0))
            ends[m.dtype] = ends.get(m.dtype, 0) + math.prod(m.shape)
        self.metas = metas
        for dtype, n in ends.items():
            self.register_parameter(
                str(dtype).split(".")[-1], torch.nn.Parameter(torch.full((n,), float("nan"), dtype=dtype), False)
            )

    def region(self, name: str) -> torch.Tensor:
        flat, start = self.where[name]
        shape = self.metas[name].shape
        return getattr(self, flat).data[start : start + math.prod(shape)].view(shape)

    def load_weights(self, named):
        for name, w in named:
            self.region(name).copy_(w)


@pytest.fixture
def sglang_fleet(ipc, monkeypatch):
    """A trainer and one rollout whose engine is the SGLang adapter over a FlatModel of the rollout's tensors
    (its fake worker runs our loader), the rollout's bus on the CPU, every trainer weight in several buckets."""
    from rollout_svc.engine import factory
    from tests.support.local_apps import local_fleet

    made = {}
    real = factory.make_engine

    def make_engine(cfg):
        metas = real(cfg).param_metas()
        model = FlatModel(metas)
        _, sgl, eng, _ = _rollout(ipc, model=model)
        eng._metas = metas
        eng.receive_device = lambda: None  # the bus on the CPU (the adapter says cuda)
        made.update(model=model, sgl=sgl, eng=eng)
        return eng

    monkeypatch.setattr(factory, "make_engine", make_engine)
    with local_fleet({"s": {"apply_mode": "inplace"}}, "tok") as (trainer, rollouts, stub):
        trainer.orch.bucket_bytes = 64 << 10
        yield trainer, rollouts["s"], stub, made


def test_tcp_syncs_into_sglang_through_the_services_are_written_by_rollout_svc_after_the_first(sglang_fleet):
    from tests.support.fleet_sync import bump_weights
    from weightsync.v1 import trainer_pb2

    trainer, app, stub, made = sglang_fleet
    model, sgl = made["model"], made["sgl"]
    for version in range(3):
        bump_weights(trainer)
        loads = list(sgl.loads)
        report = stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report
        assert report.ok, [r.error for r in report.rollouts]
        for name, t in trainer.actor.export_tensors():
            assert torch.equal(model.region(name), t), name  # SGLang's parameter is the trainer's tensor exactly
        assert app.tx.version == trainer.actor.version and app.tx.state == rollout_pb2.SERVING
        added = sgl.loads[len(loads) :]
        if version == 0:
            assert added.count("bucket") > 1 and added[-1] == "export", added  # learnt, then exported
        else:
            assert added == [], added  # no SGLang loader call: rollout-svc wrote every bucket itself
