"""Checks of our loader in SGLang's TP workers (rollout_svc/engine/sglang_loader.py), run through SGLang's own
`update_weights_from_tensor` with our `load_format` and its model classes' `load_weights` (exec_checks.py's
process; SGLang's global server args register the loader as a launch would).

Each family syncs twice: the first sync's buckets go through SGLang's loader while ours records where they
land (LEARNED), the second's (other weights) through the slot table (BY_TABLE, one copy-and-checksum pass).
After each, every parameter is compared, exactly, with a second model that SGLang's own flattened-bucket path
loaded from the same buckets, and with what the HF weights imply; each bucket's reported checksum equals the
bucket's own.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.sglang_exec.sglang_side import SglangSide, _is_0_5_2x

TABLE_FAMILIES = ("tiny-qwen2", "tiny-qwen2-tied", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")


def register_loader(side: SglangSide) -> None:
    """What `Engine(custom_weight_loader=[LOADER])` does in each worker."""
    from rollout_svc.engine.sglang_loader import LOADER

    if _is_0_5_2x():
        from sglang.srt.utils import dynamic_import

        side.updater.custom_weight_loaders[LOADER] = dynamic_import(LOADER)
    else:
        loaders = side.updater.server_args.custom_weight_loader
        if LOADER not in loaders:
            loaders.append(LOADER)


def direct_adapter(side: SglangSide):
    from rollout_svc.engine import sglang_loader as sl
    from tests.sglang_exec.exec_checks import adapter

    eng = adapter(side)
    eng._direct_rows = [torch.zeros(16, sl.RESULT_WORDS, dtype=torch.int64)]  # the result rows, in shared CPU memory
    eng.direct_cpu = True
    return eng


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def sync_twice(family: str) -> None:
    from rollout_svc.engine import sglang_loader as sl
    from tests.sglang_exec.exec_checks import _model, assert_model_holds, several_buckets, trainer_export
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.copy.verified_copy import pending_values

    calls = 0
    for seed, want in ((3, sl.LEARNED), (4, sl.BY_TABLE)):
        cfg, named = trainer_export(family, seed=seed)
        if seed == 3:
            model = _model(cfg)
            side = SglangSide(model)
            register_loader(side)
            eng = direct_adapter(side)
        ref = _model(cfg)
        ref_eng = direct_adapter(SglangSide(ref))
        buckets = several_buckets(named)
        # the first bucket alone (as the transaction's first, checked before the write), the rest queued and
        # written by one call when the first queued checksum is read (as at the commit)
        got = [eng.load_bucket_summed(*buckets[0])]
        queued = [eng.queue_bucket_summed(plan, buf) for plan, buf in buckets[1:]]
        assert len(side.calls) == calls + 1, "a queued bucket was written before its checksum was read"
        got += pending_values(queued)
        calls = len(side.calls)
        assert calls == (2 if seed == 3 else 4) - (len(buckets) == 1), f"{calls} SGLang calls for 2 syncs"
        for (plan, buf), ck in zip(buckets, got):
            assert ck == bucket_checksum(buf[: plan.nbytes]), f"bucket {plan.index}: reported checksum differs"
            assert eng.direct_how[plan.index] == want, (
                f"bucket {plan.index} ({[s.meta.name for s in plan.slots][:4]}...): written by "
                f"{eng.direct_how[plan.index]}, expected {want}; the worker's log says why"
            )
            ref_eng._send_flattened(ref_eng.bucket_payloads(plan, buf))  # SGLang's own path
        assert_model_holds(model, cfg, named)
        mine, theirs = _params(model), _params(ref)
        for n, t in theirs.items():
            assert torch.equal(mine[n], t), f"{n}: our loader's parameter differs from SGLang's loader's"
    assert all(k == "update_weights_from_tensor" for k, _ in side.calls)
    assert {kw["load_format"] for _, kw in side.calls} == {sl.LOADER}


def check_direct_failure_is_reported() -> None:
    """A bucket the worker cannot load (its header names more bytes than it holds) comes back as a failed
    status, not as a stopped scheduler; the adapter raises, naming the rank."""
    from rollout_svc.engine.sglang_weights import SglangUpdateError
    from tests.sglang_exec.exec_checks import _model, packed_buckets, trainer_export

    cfg, named = trainer_export("tiny-qwen2")
    side = SglangSide(_model(cfg))
    register_loader(side)
    eng = direct_adapter(side)
    plan, buf = packed_buckets(named)[0]
    try:
        eng.load_bucket_summed(plan, buf[: plan.nbytes - 4])
    except SglangUpdateError as exc:
        assert "TP rank 0 did not load it (failed" in str(exc), str(exc)
    else:
        raise AssertionError("a bucket shorter than its plan was reported as loaded")


def check_direct_forwards_the_trainers_handle() -> None:
    """Colocated: the bucket mapped from the trainer's handle goes to SGLang as that handle (nothing copied in
    rollout-svc); SGLang's patched rebuild gets the handle's fields and our loader writes the model."""
    from torch.multiprocessing import reductions

    from rollout_svc.engine import sglang_loader as sl
    from tests.sglang_exec.exec_checks import _model, assert_model_holds, packed_buckets, trainer_export
    from weightsync.bus.ipc.handles import consuming

    cfg, named = trainer_export("tiny-qwen2")
    model = _model(cfg)
    side = SglangSide(model)
    register_loader(side)
    eng = direct_adapter(side)
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    opened = {}
    uuid = "GPU-8e3c-stand-in"
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_properties = lambda d: SimpleNamespace(uuid=uuid)
    real = reductions._rebuild_cuda_tensor_original
    reductions._rebuild_cuda_tensor_original = lambda *a: opened[a[7]][: a[1][0]]  # stands in for the IPC open
    eng.opts = SimpleNamespace(direct_loader=True, base_gpu_id=0)
    try:
        for plan, buf in packed_buckets(named):
            h = SimpleNamespace(
                handle=b"h%04d" % plan.index,
                device_uuid=uuid,
                device=0,
                storage_size=buf.numel(),
                storage_offset=0,
                ref_counter_handle=b"rc",
                ref_counter_offset=0,
                event_handle=b"ev",
                event_sync_required=False,
            )
            opened[bytes(h.handle)] = buf
            mapped = buf[: plan.nbytes]
            with consuming(mapped, h):
                assert type(eng._direct_source(mapped)).__name__ == "_IpcTensor", "the mapped bucket was not forwarded"
                eng.load_bucket_summed(plan, mapped)
            assert eng.direct_how[plan.index] == sl.LEARNED
    finally:
        reductions._rebuild_cuda_tensor_original = real
    assert_model_holds(model, cfg, named)


def check_peer_handles_open_on_each_ranks_gpu() -> None:
    """tp_size=2: the trainer's handle goes to SGLang as its per-rank LocalSerializedTensor; SGLang's own unwrap
    (`_unwrap_tensor`, then the patched rebuild that matches GPUs by UUID) opens rank r's on GPU r, so its
    `.to(device)` moves nothing (sglang_peer.py)."""
    from torch.multiprocessing import reductions

    from rollout_svc.engine import sglang_peer
    from rollout_svc.engine.sglang_weights import _IpcTensor

    if _is_0_5_2x():
        from sglang.srt.model_executor.model_runner_components.weight_updater import _unwrap_tensor
    else:
        from sglang.srt.model_executor.model_runner import _unwrap_tensor
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    uuids = ["GPU-aaaa-stand-in", "GPU-bbbb-stand-in"]
    opened_on = []
    saved = torch.cuda.device_count, torch.cuda.get_device_properties
    torch.cuda.device_count = lambda: 2
    torch.cuda.get_device_properties = lambda d: SimpleNamespace(uuid=uuids[d])
    sglang_peer.gpu_uuid.cache_clear()
    real = reductions._rebuild_cuda_tensor_original

    def rebuild(*a):  # stands in for the IPC open: records the device SGLang's rebuild asks for
        opened_on.append(a[6])
        return torch.zeros(a[1][0], dtype=torch.uint8)

    reductions._rebuild_cuda_tensor_original = rebuild
    h = SimpleNamespace(
        handle=b"h0001",
        device_uuid=uuids[0],
        device=0,
        storage_size=64,
        storage_offset=0,
        ref_counter_handle=b"rc",
        ref_counter_offset=0,
        event_handle=b"ev",
        event_sync_required=False,
    )
    try:
        entry = sglang_peer.per_rank(_IpcTensor(h, 64), [0, 1])
        for rank in (0, 1):
            got = _unwrap_tensor(entry, tp_rank=rank, device="cpu")
            assert got.numel() == 64
    finally:
        reductions._rebuild_cuda_tensor_original = real
        torch.cuda.device_count, torch.cuda.get_device_properties = saved
        sglang_peer.gpu_uuid.cache_clear()
    assert opened_on == [0, 1], f"rank r's handle opened on GPUs {opened_on}, expected [0, 1]"


CHECKS = {
    **{f"direct_loader_two_syncs[{f}]": (lambda f=f: sync_twice(f)) for f in TABLE_FAMILIES},
    "direct_loader_failure_reported": check_direct_failure_is_reported,
    "direct_loader_forwards_trainer_handle": check_direct_forwards_the_trainers_handle,
    "direct_loader_peer_handles_per_rank": check_peer_handles_open_on_each_ranks_gpu,
}
