"""Colocated RL through SGLang's own scheduler code (issue 47 item 3): the rollout's transaction releases SGLang's
memory, then an in-place sync maps it again, with SGLang's `release_memory_occupation` /
`resume_memory_occupation` (0.5.10: `SchedulerUpdateWeightsMixin`; 0.5.2x: `SchedulerWeightUpdaterManager`) run
on a stand-in scheduler that holds the real model and the gloo TP group, and our loader writing the buckets in
SGLang's worker code (direct_checks.py). torch_memory_saver is the stand-in: a pause of "weights" turns every
parameter and buffer to NaN, as the unmapped pages come back without their contents on a GPU; SGLang itself
must put the buffers back (its stashed static state) and the sync every parameter. Checked: the tags in the
order the adapter asks for them pass SGLang's own bookkeeping (a tag resumed twice raises there), the slot
table learnt before the release writes every bucket after it, and the model then holds the new weights
exactly, its buffers as before.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from tests.sglang_exec.sglang_side import SglangSide, _is_0_5_2x


class _Saver:
    """Stands in for torch_memory_saver (SGLang's TorchMemorySaverAdapter): records pause/resume per tag."""

    def __init__(self, model):
        self.model, self.events = model, []

    def pause(self, tag):
        self.events.append(("pause", tag))
        if tag == "weights":  # the pages are unmapped: whatever comes back holds garbage
            with torch.no_grad():
                for t in [*self.model.parameters(), *self.model.buffers()]:
                    if t.is_floating_point():
                        t.fill_(float("nan"))

    def resume(self, tag):
        self.events.append(("resume", tag))


def _scheduler(model, saver):
    """SGLang's scheduler-side release/resume, bound to an object holding what those methods read."""
    tp_worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    if _is_0_5_2x():
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

        return SchedulerWeightUpdaterManager(
            tp_worker=tp_worker,
            draft_worker=None,
            memory_saver_adapter=saver,
            flush_cache=lambda: True,
            is_fully_idle=lambda **_: True,
        )
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin as M

    cls = type(
        "SchedulerMemory", (), {m: getattr(M, m) for m in ("release_memory_occupation", "resume_memory_occupation")}
    )
    s = cls()
    s.tp_worker, s.memory_saver_adapter, s.offload_tags = tp_worker, saver, set()
    s.is_fully_idle, s.flush_cache, s.tp_cpu_group = (lambda **_: True), (lambda: True), get_tp_group().cpu_group
    return s


class ColocatedSide(SglangSide):
    """SglangSide plus the Engine's memory and cache calls, ending in SGLang's scheduler code."""

    def __init__(self, model):
        super().__init__(model)
        self.saver = _Saver(model)
        self.scheduler = _scheduler(model, self.saver)
        self.tokenizer_manager = SimpleNamespace()  # no pause/continue here: begin_apply skips them

    def release_memory_occupation(self, tags=None):
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self.calls.append(("release_memory_occupation", dict(tags=tags)))
        return self.scheduler.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags))

    def resume_memory_occupation(self, tags=None):
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        self.calls.append(("resume_memory_occupation", dict(tags=tags)))
        return self.scheduler.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags))

    def flush_cache(self):
        self.calls.append(("flush_cache", {}))
        return True


def _sync(tx, named, version: int) -> None:
    from tests.sglang_exec.exec_checks import BUCKET_BYTES
    from tests.support.packed import packed_sync
    from weightsync.bus.copy.checksum import bucket_checksum

    m, bufs = packed_sync(dict(named), version=version, sync_id=f"s{version}", bucket_bytes=BUCKET_BYTES)
    sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
    tx.prepare(m, timeout=60)
    for i, buf in enumerate(bufs):
        tx.consume_bucket(m.sync_id, i, buf, sums[i])
    tx.commit(m.sync_id, version, sums)


def check_release_sync_resume(family: str = "tiny-qwen2") -> None:
    from rollout_svc.engine import sglang_loader as sl
    from rollout_svc.engine.sglang_engine import _hf_param_metas
    from rollout_svc.sync.transaction import SyncTransaction
    from tests.sglang_exec.direct_checks import direct_adapter, register_loader
    from tests.sglang_exec.exec_checks import EXPORT_DTYPE, _model, assert_model_holds, trainer_export

    cfg, first = trainer_export(family, seed=3)
    model = _model(cfg)
    side = ColocatedSide(model)
    register_loader(side)
    eng = direct_adapter(side)
    eng.opts = dataclasses.replace(eng.opts, colocated=True)
    eng._metas = _hf_param_metas(cfg, EXPORT_DTYPE)
    tx = SyncTransaction(eng, "inplace")
    _sync(tx, first, 1)  # learns the slot table
    assert_model_holds(model, cfg, first)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    assert any(b.is_floating_point() for b in buffers.values()), "no buffer to lose (rotary cache expected)"
    assert tx.release_memory(timeout=10) == ("weights", "kv_cache", "cuda_graph")
    assert all(torch.isnan(p).all() for p in model.parameters()), "the stand-in saver did not drop the weights"
    _, second = trainer_export(family, seed=4)
    _sync(tx, second, 2)
    assert_model_holds(model, cfg, second)
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), f"buffer {n}: SGLang's stashed static state did not come back"
    assert set(eng.direct_how.values()) == {sl.BY_TABLE}, f"written after the release by {eng.direct_how}"
    mem = [(k, kw["tags"]) for k, kw in side.calls if k.endswith("memory_occupation")]
    assert mem == [
        ("release_memory_occupation", ["weights", "kv_cache", "cuda_graph"]),
        ("resume_memory_occupation", ["weights"]),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
    ], mem
    # SGLang's own order inside each call; its offload set is empty again
    assert [e for e in side.saver.events if e[0] == "resume"] == [
        ("resume", "weights"),
        ("resume", "cuda_graph"),
        ("resume", "kv_cache"),
    ], side.saver.events
    assert not side.scheduler.offload_tags and not tx.memory_released


CHECKS = {"colocated_release_sync_resume[tiny-qwen2]": check_release_sync_resume}
