"""Start-up compilation of the FP8 Triton kernels (weightsync/formats/fp8/warm.py): which stand-in
tensors it runs, that it is free off-GPU, and that both services call it. The GPU case (nothing left
to compile for the first sync) is tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.local_apps import start_rollout, start_trainer
from weightsync.bus.plan import TensorMeta
from weightsync.formats.fp8 import blocks_triton, warm
from weightsync.formats.fp8.export import is_quantized

BLOCK = 128


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def test_a_stand_in_is_small_and_meets_the_same_specialisation():
    # what Triton specialises an integer argument on: == 1, divisibility by 16 (by 8 in older versions)
    for n in [*range(1, 600), 2047, 2048, 2049, 2175, 2176, 2177, 3584, 4096, 5120, 7168, 14336, 18944, 129280]:
        rows, cols = warm.stand_in((n, n))
        assert rows == cols <= 17 * BLOCK, n
        assert rows % BLOCK == n % BLOCK and (rows == 1) == (n == 1), n  # the kernels' rows / cols
        assert _blocks(rows) % 16 == _blocks(n) % 16 and (_blocks(rows) == 1) == (_blocks(n) == 1), n  # n_rb, n_cb
        assert warm.stand_in((5, 3, n)) == (3, cols)  # leading (expert) dimensions do not matter


def _metas(dtype):
    from bench.model_shapes import shapes

    return [TensorMeta(n, s, dtype) for n, s in shapes("7b")] + [TensorMeta("model.norm.weight", (3584,), dtype)]


class _Launches:
    def __init__(self, monkeypatch):
        self.quantize, self.dequantize = [], []
        monkeypatch.setattr(blocks_triton, "quantize", lambda w: self.quantize.append((tuple(w.shape), w.dtype)))
        monkeypatch.setattr(
            blocks_triton,
            "dequantize",
            lambda q, s, dtype: self.dequantize.append((tuple(q.shape), tuple(s.shape), dtype)),
        )
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_warm_up_is_a_no_op_off_the_gpu(monkeypatch, device):
    launches = _Launches(monkeypatch)
    assert warm.warm_quantize(_metas(torch.float32), device) == 0.0
    assert warm.warm_dequantize(_metas(torch.bfloat16), device) == 0.0
    assert warm.warm_quantize_slots(device) == 0.0
    assert warm.warm_fused_write(device) == 0.0
    assert warm.warm_dequantize_into_params(device) == 0.0
    assert launches.quantize == launches.dequantize == []


def test_warm_up_is_a_no_op_without_triton(monkeypatch):
    launches = _Launches(monkeypatch)
    monkeypatch.setattr(blocks_triton, "available", lambda: False)
    assert warm.warm_quantize(_metas(torch.float32), "cuda:0") == 0.0
    assert warm.warm_dequantize(_metas(torch.bfloat16), "cuda:0") == 0.0
    assert warm.warm_quantize_slots("cuda:0") == 0.0
    assert warm.warm_fused_write("cuda:0") == 0.0
    assert warm.warm_dequantize_into_params("cuda:0") == 0.0
    assert launches.quantize == launches.dequantize == []


def test_the_slot_quantizer_is_warmed_once_per_source_dtype(monkeypatch):
    """Its arguments are all pointers: one launch per parameter dtype meets every specialisation."""
    from weightsync.formats.fp8 import quantize_slots_triton

    monkeypatch.setattr(warm, "_ready", lambda device: torch.device("cpu"))  # as on a GPU with triton
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    seen = []
    monkeypatch.setattr(quantize_slots_triton, "launch", lambda src, *rest: seen.append((src.dtype, rest[2].numel())))
    assert warm.warm_quantize_slots("cuda:0") > 0
    assert seen == [(torch.bfloat16, 1), (torch.float32, 1)]  # one block each


def test_the_fused_write_is_warmed_once_per_source_dtype_at_the_widest_access(monkeypatch):
    """fp8/write_slots.py's kernel (ipc trainer_writes of block FP8): one launch per parameter dtype, VEC 16."""
    from weightsync.formats.fp8 import write_slots

    monkeypatch.setattr(warm, "_ready", lambda device: torch.device("cpu"))  # as on a GPU with triton
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    seen = []
    monkeypatch.setattr(write_slots, "_launch", lambda la, bases, flag: seen.append((la.src_base.dtype, la.vec)))
    assert warm.warm_fused_write("cuda:0") > 0
    assert seen == [(torch.bfloat16, 16), (torch.float32, 16)]


def test_warm_up_runs_each_kernel_once_per_dtype_and_stand_in(monkeypatch):
    launches = _Launches(monkeypatch)
    monkeypatch.setattr(warm, "_ready", lambda device: torch.device("cpu"))  # as on a GPU with triton
    metas = _metas(torch.float32)
    assert warm.warm_quantize(metas, "cuda:0") > 0
    # Qwen2.5-7B: 3584 (28 blocks) and 18944 (148 blocks) and 512 (4 blocks) map onto 1536 and 512
    want = sorted({warm.stand_in(m.shape) for m in metas if is_quantized(m.name, m.shape)})
    assert want == [(512, 1536), (1536, 512), (1536, 1536)]
    assert launches.quantize == [(s, torch.float32) for s in want]
    # the engine's dtypes, for its quantizable parameters only (a float64 one goes through torch)
    engine = _metas(torch.bfloat16) + [
        TensorMeta("model.layers.0.mlp.up_proj.weight", (100, 200), torch.float16),
        TensorMeta("model.layers.1.mlp.up_proj.weight", (300, 200), torch.float64),
    ]
    assert warm.warm_dequantize(engine, "cuda:0") > 0
    assert launches.dequantize == [(s, (_blocks(s[0]), _blocks(s[1])), torch.bfloat16) for s in want] + [
        ((100, 200), (1, 2), torch.float16)
    ]


def test_the_trainer_warms_the_quantizer_at_start_up_only_for_fp8_block(monkeypatch):
    import weightsync.publisher.warm_up as warm_mod

    calls = []
    monkeypatch.setattr(warm_mod, "warm_quantize", lambda metas, device: calls.append((metas, device)) or 0.0)
    for export_dtype in ("bfloat16", "fp8-block"):
        app = start_trainer(export_dtype=export_dtype)
        try:
            assert len(calls) == (export_dtype == "fp8-block"), export_dtype
        finally:
            app.stop()
    ((metas, device),) = calls
    assert metas == app.actor.export_metas() and device == app.orch.device == torch.device("cpu")
    assert {m.dtype for m in metas} == {torch.float32}  # the dtype the fp8-block actor exports in
    assert warm.warm_quantize(metas, device) == 0.0  # and on this CPU the real one does nothing


def test_the_rollout_warms_the_dequantizer_at_start_up(monkeypatch):
    import rollout_svc.app as app_mod

    calls = []
    monkeypatch.setattr(app_mod, "fp8_dequantize_warm_up", lambda engine, device: calls.append((engine, device)) or 0.0)
    app = start_rollout("warm")
    try:
        assert calls == [(app.engine, app.servicer.device)]
    finally:
        app.stop()


def test_a_rollout_warms_the_dequantizer_only_when_its_engine_dequantizes(monkeypatch):
    import rollout_svc.quantized as quantized
    from rollout_svc.engine.base import Engine as BaseEngine

    seen = []
    monkeypatch.setattr(quantized, "_warm_dequantize", lambda metas, device: seen.append(list(metas)) or 1.0)
    fused = []  # the kernel that dequantizes whole buckets into the parameters (rollout_svc/sync/fp8_fused_write.py)
    monkeypatch.setattr(quantized, "warm_dequantize_into_params", lambda device: fused.append(device) or 0.5)
    metas = {
        "model.layers.0.mlp.up_proj.weight": TensorMeta("model.layers.0.mlp.up_proj.weight", (8, 8), torch.bfloat16)
    }

    class Engine(BaseEngine):
        load_weights = flush_cache = generate = score = num_ranks = num_parameters = prefix_cache_entries = None

        def __init__(self, native):
            self.native = native

        def param_metas(self):
            return metas

        def loads_quantized(self, quantization):
            if isinstance(self.native, Exception):
                raise self.native
            return self.native

    assert quantized.warm_dequantize(Engine(True), "cuda:0") == 0.0  # SGLang serving block FP8 takes the pairs
    assert quantized.warm_dequantize(Engine(ValueError("per-tensor FP8")), "cuda:0") == 0.0  # refused at prepare
    assert seen == [] and fused == []
    assert quantized.warm_dequantize(Engine(False), "cuda:0") == 1.5
    engine = Engine(False)
    del Engine.loads_quantized  # the base's default, as the built-in engine: it always dequantizes
    assert quantized.warm_dequantize(engine, "cuda:0") == 1.5
    assert fused == ["cuda:0", "cuda:0"]
    assert seen == [list(metas.values())] * 2


@pytest.mark.parametrize(
    "senders, export_dtype, quantized",
    [("all", "fp8-block", True), ("all", "bfloat16", False), ("rank0", "fp8-block", None)],
)
def test_a_sending_worker_rank_warms_its_kernels_for_the_tensors_it_owns(monkeypatch, senders, export_dtype, quantized):
    """With --senders all every torchrun worker packs, checksums and (fp8-block) quantizes its own
    buckets: it compiles those kernels before its first sync, for its own tensors only; in the
    funnel rank 0 does all of that and the workers warm nothing."""
    from types import SimpleNamespace

    import weightsync.publisher.warm_up as warm_mod
    from trainer_svc.warm_up import warm_up_sender

    metas = _metas(torch.float32)
    calls = []
    monkeypatch.setattr(
        warm_mod, "warm_quantize", lambda ms, device: calls.append(("quantize", list(ms), device)) or 0.0
    )
    monkeypatch.setattr(warm_mod, "bucket_checksum_warm_up", lambda device: calls.append(("checksum", device)) or 0.0)
    owners = [i % 2 for i in range(len(metas))]
    actor = SimpleNamespace(
        rank=1,
        export_owners=lambda: owners,
        export_metas=lambda: list(metas),
        parameters=lambda: iter([torch.zeros(1)]),
    )
    cfg = SimpleNamespace(bus=SimpleNamespace(senders=senders), actor=SimpleNamespace(export_dtype=export_dtype))
    warm_up_sender(actor, cfg)
    if quantized is None:
        assert calls == []
        return
    mine = [m for m, o in zip(metas, owners) if o == 1]
    want = [("checksum", torch.device("cpu"))] + ([("quantize", mine, torch.device("cpu"))] if quantized else [])
    assert calls == want


def test_the_fused_dequantize_is_warmed_with_one_launch(monkeypatch):
    """One bucket of a scale and its weight: word programs and a block program in one launch (its
    word count is not specialised, so this one compile serves every bucket)."""
    from weightsync.formats.fp8 import dequantize_slots_triton

    monkeypatch.setattr(warm, "_ready", lambda device: torch.device("cpu"))  # as on a GPU with triton
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    seen = []

    def launch(buf, bases, words, tensors, owners, *consts):
        seen.append((words.shape[0], tensors.shape[0], owners.numel()))
        return torch.zeros(2, dtype=torch.int64)

    monkeypatch.setattr(dequantize_slots_triton, "launch", launch)
    assert warm.warm_dequantize_into_params("cuda:0") > 0
    assert seen == [(2, 1, 1)]  # word rows: the scale, the alignment gap after it; one block program
