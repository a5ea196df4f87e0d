"""The trainer writes into SGLang (rollout_svc/engine/sglang_export.py): the slot tables our loader learnt in
SGLang's worker exported as the trainer's destination table, on a toy model (test_sglang_loader.py's) behind a
stand-in for SGLang's Engine that runs our loader in-process. The table is mapped and written by the trainer's
own code (trainer_writes.Destinations, TrainerWriteSender) through a stand-in for CUDA IPC; tests/sglang_exec
runs the same against SGLang's real model classes and update_weights_from_tensor."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from rollout_svc.engine import sglang_loader as sl
from rollout_svc.engine.sglang_engine import SglangEngine, SglangOptions
from tests.unit.rollout_svc.engine.sglang.test_sglang_loader import Toy, _bucket
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.ipc.trainer_writes import Destinations, TrainerWriteSender
from weightsync.bus.plan import Manifest


class FakeSgl:
    """SGLang's Engine as far as the export goes: update_weights_from_tensor runs our loader on the model."""

    def __init__(self, model):
        self.model, self.calls, self.released = model, [], 0

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == sl.LOADER and not flush_cache
        self.calls.append([n for n, _ in named_tensors][0][:10])
        sl.load(self.model, named_tensors)
        return True, "Succeeded"

    def release_memory_occupation(self, tags=None):
        self.released += 1


def _engine(model, **opts) -> SglangEngine:
    eng = SglangEngine.__new__(SglangEngine)  # no SGLang started
    eng.opts = SglangOptions(model_path="/m", **opts)
    eng.tp_size, eng._sgl = eng.opts.tp_size, FakeSgl(model)
    eng._direct_rows = [torch.zeros(16, sl.RESULT_WORDS, dtype=torch.int64) for _ in range(eng.tp_size)]
    eng.direct_cpu = True
    return eng


def _sync(eng, seed: int):
    """One rollout_reads sync of one bucket through our loader, as the transaction drives it."""
    plan, buf, named = _bucket(seed)
    eng.sync_layouts = {}  # (begin_apply)
    assert eng.load_bucket_summed(plan, buf) == bucket_checksum(buf[: plan.nbytes])
    eng.export_after_sync()  # (end_apply)
    return plan, buf, named


def _manifest(plan) -> Manifest:
    return Manifest(version=1, sync_id="s", bucket_bytes=plan.nbytes, buckets=[plan], checksum_algo="ws-sum64-v1")


def test_the_table_is_exported_once_after_the_learning_sync_and_the_trainer_writes_sglangs_regions(ipc):
    model = Toy()
    eng = _engine(model)
    plan, _, _ = _bucket(1)
    assert eng.ipc_destinations(_manifest(plan)) is None  # nothing learnt: the first sync reads
    _sync(eng, 1)
    assert [c.startswith(sl.HEADER) for c in eng._sgl.calls] == [True, False]  # the bucket, then the export
    assert eng.ipc_destinations(_manifest(plan)) is not None
    _sync(eng, 2)  # the same layout again (written by the table): nothing exported again
    assert len(eng._sgl.calls) == 3
    table_id, table = eng.ipc_destinations(_manifest(plan))
    assert table_id.startswith("sglang-") and [t.name for t in table.tensors] == ["q", "k", "v", "embed"]
    assert len(table.allocations) == 2  # qkv and embed: each storage shared once
    assert not os.listdir(eng._export_dir), "the exported file was left behind"

    # the trainer: validate against the manifest, map, write a third version, with no SGLang call
    plan3, buf3, named3 = _bucket(3)
    dests = Destinations(_manifest(plan3), table, ipc.open)
    writer = TrainerWriteSender(dests, "r0")
    writer.send(plan3, buf3, None)
    writer.flush()
    assert writer.checksums() == [bucket_checksum(buf3[: plan3.nbytes])]
    assert len(eng._sgl.calls) == 3
    ref = Toy()
    ref.load_weights(sl.views(plan3, buf3))  # what the model's own loader makes of the same bucket
    assert torch.equal(model.qkv, ref.qkv) and torch.equal(model.embed[:10], named3["embed"])
    assert torch.equal(model.embed, ref.embed)  # the spare rows stay as SGLang's loader left them (zeros)


@pytest.mark.parametrize(
    "opts, quantized",
    [({"colocated": True}, False), ({"direct_loader": False}, False), ({}, True)],
)
def test_memory_saver_no_loader_or_a_quantized_manifest_never_offer_nor_export(ipc, opts, quantized):
    """(tp_size > 1: each rank's table is exported for rollout-svc's writes, never offered to the trainer:
    test_sglang_tp_rollout_writes.py)"""
    eng = _engine(Toy(), **opts)
    if not quantized:  # (a dequantized sync's buckets never reach our loader: no layout to export)
        eng.sync_layouts = {0: "some-layout"}
        eng.export_after_sync()
        assert eng._sgl.calls == [] and not eng.__dict__.get("_dest_tables")
    plan, _, _ = _bucket(1)
    eng.__dict__["_dest_tables"] = {(sl.layout_key(plan),): ("id", object())}  # even with a table at hand
    m = _manifest(plan)
    if quantized:
        m = dataclasses.replace(m, quantization=object())
    assert eng.ipc_destinations(m) is None


def test_a_layout_sglangs_loader_writes_itself_is_asked_once_and_never_offered(ipc):
    eng = _engine(Toy(mode="shard"))  # a TP shard narrowed out of each tensor: no slot table
    plan, _, _ = _bucket(1)
    for seed in (1, 2, 3):
        _sync(eng, seed)
    exports = [c for c in eng._sgl.calls if c.startswith(sl.EXPORT)]
    assert len(exports) == 1 and eng.ipc_destinations(_manifest(plan)) is None


def test_a_layout_another_path_wrote_in_part_is_not_exported(ipc):
    """Only a sync whose every bucket went through our loader names the whole layout."""
    eng = _engine(Toy())
    _sync(eng, 1)
    eng.__dict__.pop("_dest_tables")
    eng.sync_layouts = {1: "a-later-bucket-only"}
    eng.export_after_sync()
    assert len(eng._sgl.calls) == 2  # no new export call


def test_releasing_sglangs_memory_forgets_every_table(ipc):
    eng = _engine(Toy())
    plan, _, _ = _bucket(1)
    _sync(eng, 1)
    assert eng.ipc_destinations(_manifest(plan)) is not None
    eng.release_memory(["weights"])
    assert eng._sgl.released == 1 and eng.ipc_destinations(_manifest(plan)) is None


def test_the_ipc_receiver_asks_the_engine_for_its_table_and_never_for_its_parameters(ipc):
    from types import SimpleNamespace

    from weightsync.bus.ipc.receiver import IpcReceiver

    eng = _engine(Toy())
    eng.writable_params = lambda metas: pytest.fail("writable_params asked of an engine that exports its table")
    plan, _, _ = _bucket(1)
    m = dataclasses.replace(_manifest(plan), layout_digest="d1")
    rx = IpcReceiver(SimpleNamespace(apply_mode="inplace", engine=eng), torch.device("cpu"), "sglang", maps=object())
    assert rx.destinations(m) is None
    _sync(eng, 1)
    assert rx.destinations(m) == eng.ipc_destinations(m) is not None
    rx.tx.apply_mode = "staged"
    assert rx.destinations(m) is None


def test_a_failed_export_call_does_not_fail_the_sync_and_is_not_retried(ipc):
    eng = _engine(Toy())
    real = eng._sgl.update_weights_from_tensor

    refused = []

    def refuse_exports(named_tensors, **kw):
        if named_tensors[0][0].startswith(sl.EXPORT):
            refused.append(1)
            return False, "refused"
        return real(named_tensors, **kw)

    eng._sgl.update_weights_from_tensor = refuse_exports
    plan, _, _ = _bucket(1)
    _sync(eng, 1)  # end_apply's export raised inside: logged, the sync goes on
    _sync(eng, 2)
    assert eng.ipc_destinations(_manifest(plan)) is None and len(eng._sgl.calls) == 2  # both syncs loaded
    assert refused == [1]  # asked once, not again at the next sync
