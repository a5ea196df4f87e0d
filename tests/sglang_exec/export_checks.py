"""Checks of the slot tables exported as the trainer's destination table (rollout_svc/engine/sglang_export.py),
through SGLang's own `update_weights_from_tensor` and model classes (exec_checks.py's process).

A first sync goes through our loader in SGLang's worker (it learns the slot tables); at its end the adapter
exports them. The exported IpcDestinations is then validated and mapped by the trainer's own code
(weightsync/bus/ipc/trainer_writes.py `Destinations`: every manifest tensor, dtype, shape, size, inside its
allocation), with a stand-in for CUDA IPC that maps a handle back to the same storage, and a second sync's
buckets (other weights) are written through it by the trainer's own write pass (`TrainerWriteSender`, on a CPU
verified_copy's torch copy-and-sum), with no SGLang call. Every parameter must then equal, exactly, a second
model that SGLang's own flattened-bucket path loaded from the same buckets, and what the HF weights imply;
the trainer's checksums must be the buckets' own. rollout-svc's own write of NCCL/TCP buckets maps the same table
(rollout_svc/engine/sglang_mapped.py) and is checked the same way.
"""

from __future__ import annotations

import torch

from tests.sglang_exec.direct_checks import TABLE_FAMILIES, _params, direct_adapter, register_loader
from tests.sglang_exec.sglang_side import SglangSide


class _FakeIpc:
    """Handles name storages of this process: `open` gives back the same memory, as a mapping would."""

    def __init__(self):
        self.memory: dict[bytes, torch.Tensor] = {}

    def share(self, whole: torch.Tensor):
        from weightsync.v1 import bus_pb2

        assert whole.storage_offset() == 0 and whole.dtype == torch.uint8
        key = f"h{whole.data_ptr()}".encode()
        self.memory[key] = whole
        return bus_pb2.CudaIpcHandle(handle=key, storage_size=whole.numel())

    def open(self, h) -> torch.Tensor:
        return self.memory[bytes(h.handle)]


def _manifest(named, seq: int):
    from tests.sglang_exec.exec_checks import BUCKET_BYTES
    from weightsync.bus.plan import TensorMeta, make_manifest

    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
    return make_manifest(metas, version=seq, sync_id=f"s{seq}", bucket_bytes=BUCKET_BYTES, checksum_algo="ws-sum64-v1")


def _learnt(family: str, ipc: _FakeIpc):
    """A first sync of `family` through our loader in SGLang's worker, then the export at its end: (SGLang's side,
    the adapter, the model SGLang serves, the table exported)."""
    from tests.sglang_exec.exec_checks import _model, packed_buckets, trainer_export

    cfg, named = trainer_export(family, seed=3)
    model = _model(cfg)
    side = SglangSide(model)
    register_loader(side)
    eng = direct_adapter(side)
    eng.open_allocation = ipc.open  # rollout-svc maps the exported table (sglang_mapped.py)
    manifest = _manifest(named, 1)
    assert eng.ipc_destinations(manifest) is None, "a table was offered before any sync learnt the layouts"
    eng.sync_layouts = {}  # (begin_apply)
    for plan, buf in packed_buckets(named):
        eng.load_bucket_summed(plan, buf)
    calls = len(side.calls)
    eng.export_after_sync()  # (end_apply)
    assert len(side.calls) == calls + 1, "the export is one SGLang call"
    eng.export_after_sync()
    assert len(side.calls) == calls + 1, "a layout's table is exported once"
    got = eng.ipc_destinations(manifest)
    assert got is not None, "the learnt layouts were not exported (the worker's log says why)"
    assert got[0].startswith("sglang-") and len(got[1].tensors) == len(named)
    return side, eng, model, got


def _assert_as_sglangs_loader(family: str, model, cfg, named, buckets, who: str) -> None:
    """`model` holds exactly what SGLang's own flattened-bucket path makes of `buckets`, and what `named` implies."""
    from tests.sglang_exec.exec_checks import _model, assert_model_holds

    ref = _model(cfg)
    ref_eng = direct_adapter(SglangSide(ref))
    for plan, buf in buckets:
        ref_eng._send_flattened(ref_eng.bucket_payloads(plan, buf))  # SGLang's own path
    assert_model_holds(model, cfg, named)
    mine, theirs = _params(model), _params(ref)
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), f"{n}: {who}'s write through the table differs from SGLang's loader"


def trainer_writes_through_the_table(family: str) -> None:
    from rollout_svc.engine import sglang_export_worker
    from tests.sglang_exec.exec_checks import several_buckets, trainer_export
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.ipc.trainer_writes import Destinations, TrainerWriteSender

    ipc = _FakeIpc()
    sglang_export_worker.share_storage = ipc.share
    try:
        side, eng, model, got = _learnt(family, ipc)
        cfg, named = trainer_export(family, seed=4)
        manifest = _manifest(named, 2)
        assert eng.ipc_destinations(manifest) == got, "another sync of the same layouts is offered the same table"
        dests = Destinations(manifest, got[1], ipc.open)  # the trainer's validation of every entry
        buckets = several_buckets(named)
        writer = TrainerWriteSender(dests, "r0")
        calls = len(side.calls)
        for plan, buf in buckets:
            writer.send(plan, buf, None)
        writer.flush()
        assert len(side.calls) == calls, "SGLang was called while the trainer wrote"
        want = [bucket_checksum(buf[: plan.nbytes]) for plan, buf in buckets]
        assert writer.checksums() == want, "the trainer's checksums differ from the buckets'"
        _assert_as_sglangs_loader(family, model, cfg, named, buckets, "the trainer")
    finally:
        sglang_export_worker.share_storage = None


def rollout_writes_through_the_table(family: str) -> None:
    """rollout-svc's own NCCL/TCP write (rollout_svc/engine/sglang_mapped.py): the exported table mapped in
    rollout-svc, offered as `writable_params` while SGLang is paused, and written by the in-place apply's
    copy-and-checksum (verified_copy.copy_into), with no SGLang call."""
    from rollout_svc.engine import sglang_export_worker
    from tests.sglang_exec.exec_checks import several_buckets, trainer_export
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.copy.verified_copy import copy_into

    ipc = _FakeIpc()
    sglang_export_worker.share_storage = ipc.share
    try:
        side, eng, model, _ = _learnt(family, ipc)
        cfg, named = trainer_export(family, seed=4)
        buckets = several_buckets(named)
        calls = len(side.calls)
        metas = [slot.meta for slot in buckets[0][0].slots]
        assert eng.writable_params(metas) is None, "SGLang's parameters were offered outside a paused sync"
        eng.writing_in_place = True  # (begin_apply)
        for plan, buf in buckets:
            params = eng.writable_params([slot.meta for slot in plan.slots])
            assert params is not None, f"bucket {plan.index}: the mapped table does not cover it"
            assert copy_into(plan, buf, params) == bucket_checksum(buf[: plan.nbytes]), f"bucket {plan.index}"
        assert len(side.calls) == calls, "SGLang was called while rollout-svc wrote"
        _assert_as_sglangs_loader(family, model, cfg, named, buckets, "rollout-svc")
    finally:
        sglang_export_worker.share_storage = None


def check_unlearnt_layout_is_given_up() -> None:
    """A layout whose slot table SGLang's loader could not give (here: its worker forgot it, as a model that was
    rebuilt) is answered UNLEARNED, asked again a bounded number of times, then never offered."""
    from rollout_svc.engine import sglang_export
    from tests.sglang_exec.exec_checks import _model, packed_buckets, trainer_export

    cfg, named = trainer_export("tiny-qwen2", seed=3)
    model = _model(cfg)
    side = SglangSide(model)
    register_loader(side)
    eng = direct_adapter(side)
    eng.sync_layouts = {}
    for plan, buf in packed_buckets(named):
        eng.load_bucket_summed(plan, buf)
    model.__dict__.pop("_ws_slot_tables")
    calls = len(side.calls)
    for _ in range(sglang_export.EXPORT_TRIES + 2):
        eng.export_after_sync()
    assert len(side.calls) == calls + sglang_export.EXPORT_TRIES, f"{len(side.calls) - calls} export calls"
    assert eng.ipc_destinations(_manifest(named, 1)) is None


CHECKS = {
    **{f"trainer_writes_through_table[{f}]": (lambda f=f: trainer_writes_through_the_table(f)) for f in TABLE_FAMILIES},
    **{f"rollout_writes_through_table[{f}]": (lambda f=f: rollout_writes_through_the_table(f)) for f in TABLE_FAMILIES},
    "export_unlearnt_layout_given_up": check_unlearnt_layout_is_given_up,
}
