"""The checks of the SGLang execution tier; run as `python -m tests.sglang_exec.exec_checks <version>`
(one fresh interpreter per SGLang version, see tests/support/sglang_site.py). Prints one line,
RESULT_MARK + JSON {check name: "ok" | traceback}; test_sglang_exec.py turns each into a test.
"""

from __future__ import annotations

import json
import sys
import traceback
from types import SimpleNamespace

import torch

from tests.sglang_exec.colocated_checks import CHECKS as COLOCATED_CHECKS
from tests.sglang_exec.direct_checks import CHECKS as DIRECT_CHECKS
from tests.sglang_exec.export_checks import CHECKS as EXPORT_CHECKS
from tests.sglang_exec.fp8_checks import CHECKS as FP8_CHECKS
from tests.sglang_exec.sglang_side import SglangSide, build_model, init_tp1
from tests.support.sglang_site import RESULT_MARK, activate

FAMILIES = ("tiny-qwen2", "tiny-qwen2-tied", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe")
BUCKET_BYTES = 16 << 10  # small, so every family spans several buckets
EXPORT_DTYPE = torch.bfloat16


# ---- what the trainer sends ---------------------------------------------------------------
def trainer_export(family: str, seed: int = 3) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    """The HF-named tensors a sync of `family` carries, in the trainer's export order and names.

    Names/shapes/order are the Megatron trainer's export list (`trainer_svc.actor.megatron.hf_meta.export_metas`,
    checkpoint naming: per-expert tensors for MoE); values come from a transformers model of the
    same config. transformers 5 stores MoE experts fused (`experts.gate_up_proj` [E, 2I, H],
    gate rows first; `experts.down_proj` [E, H, I]); they are split per expert here.
    """
    from trainer_svc.actor.hf.actor import HfActor
    from trainer_svc.actor.megatron.hf_meta import build_spec, export_metas
    from weightsync.models import resolve_model

    cfg, _ = resolve_model(family)
    state = dict(HfActor(cfg, seed=seed).export_tensors())
    for key in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        pre = key[: -len("gate_up_proj")]
        gate_up, down = state.pop(key), state.pop(pre + "down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            state[f"{pre}{e}.gate_proj.weight"] = gate_up[e, :inter]
            state[f"{pre}{e}.up_proj.weight"] = gate_up[e, inter:]
            state[f"{pre}{e}.down_proj.weight"] = down[e]
    metas = export_metas(build_spec(cfg), EXPORT_DTYPE)
    assert sorted(m.name for m in metas) == sorted(state), "trainer export list != HF checkpoint names"
    out = []
    for m in metas:
        t = state[m.name].to(EXPORT_DTYPE).contiguous()
        assert tuple(t.shape) == tuple(m.shape), (m.name, t.shape, m.shape)
        out.append((m.name, t))
    return cfg, out


def expected_sglang_params(cfg, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What every SGLang parameter must hold after loading `hf` (written from the HF semantics,
    not from SGLang's loader): q/k/v stacked into qkv_proj (q, k, v), gate/up into gate_up_proj
    (gate, up; also a Qwen2-MoE shared expert's), per-expert gate/up into experts.w13_weight[e] (w1=gate, w3=up),
    down into
    experts.w2_weight[e]; a tied lm_head is the embedding."""
    exp: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            exp[name.replace("q_proj", "qkv_proj")] = torch.cat([t, k, v])
        elif ".mlp.experts." in name:
            pre, rest = name.split(".mlp.experts.")
            e, which = int(rest.split(".")[0]), rest.split(".")[1]
            if which == "down_proj":
                exp.setdefault(f"{pre}.mlp.experts.w2_weight", {})[e] = t
            elif which == "gate_proj":
                up = hf[name.replace("gate_proj", "up_proj")]
                exp.setdefault(f"{pre}.mlp.experts.w13_weight", {})[e] = torch.cat([t, up])
        elif name.endswith((".gate_proj.weight", ".gate_proj.weight_scale_inv")):  # dense MLP, or a shared expert
            exp[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, hf[name.replace("gate_proj", "up_proj")]])
        elif name.endswith((".up_proj.weight", ".up_proj.weight_scale_inv")):  # (block FP8: fp8_checks.py)
            continue
        else:
            exp[name] = t
    for k, v in list(exp.items()):
        if isinstance(v, dict):
            exp[k] = torch.stack([v[e] for e in range(len(v))])
    if cfg.tie_word_embeddings:
        exp["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return exp


def assert_model_holds(model, cfg, hf_named: list[tuple[str, torch.Tensor]]) -> int:
    exp = expected_sglang_params(cfg, dict(hf_named))
    params = dict(model.named_parameters(remove_duplicate=False))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied lm_head is not the embedding"
    assert set(params) == set(exp), (
        f"SGLang params without an HF source: {sorted(set(params) - set(exp))}; "
        f"HF tensors with no SGLang param: {sorted(set(exp) - set(params))}"
    )
    for name, p in params.items():
        want = exp[name].to(p.dtype)
        assert p.shape == want.shape, f"{name}: SGLang {tuple(p.shape)} vs expected {tuple(want.shape)}"
        assert torch.equal(p.detach(), want), f"{name}: SGLang's parameter differs from what the HF weights imply"
    return len(params)


# ---- the adapter, with SGLang's receive side behind it --------------------------------------
def adapter(side, tp: int = 1):
    import threading

    from rollout_svc.engine.sglang_engine import SglangEngine, SglangOptions

    eng = SglangEngine.__new__(SglangEngine)  # no _start: SGLang's scheduler is not launched
    eng.opts = SglangOptions(model_path="/m", tp_size=tp)
    eng.tp_size, eng._metas, eng._lock, eng._update_group = tp, {}, threading.RLock(), ""
    eng._sgl = side
    return eng


def packed_buckets(named, bucket_bytes=BUCKET_BYTES):
    from weightsync.bus.pack import alloc_buffer, pack_bucket
    from weightsync.bus.plan import TensorMeta, plan_buckets

    plans = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], bucket_bytes)
    it = iter(named)
    out = []
    for plan in plans:
        buf = alloc_buffer(bucket_bytes if plan.nbytes <= bucket_bytes else plan.nbytes)
        buf.fill_(0xAB)  # padding bytes are garbage on purpose: only the plan's offsets may be read
        pack_bucket(plan, [next(it) for _ in plan.slots], buf)
        out.append((plan, buf))
    return out


#: a sync "in several buckets": the hand-over from one bucket to the next is exercised, not one bucket alone
MIN_BUCKETS = 4


def several_buckets(named, bucket_bytes=BUCKET_BYTES):
    """`packed_buckets`, refusing a layout of fewer than MIN_BUCKETS buckets (a check of one bucket would pass
    however the adapter carried state from a bucket to the next)."""
    out = packed_buckets(named, bucket_bytes)
    assert len(out) >= MIN_BUCKETS, f"{len(out)} buckets of {bucket_bytes} bytes: lower bucket_bytes"
    return out


def dense_plan(named, index=0):
    """A bucket laid out as SGLang's distributed flattened receive expects: no padding."""
    from weightsync.bus.plan import BucketPlan, Slot, TensorMeta

    plan, off = BucketPlan(index=index), 0
    for n, t in named:
        m = TensorMeta(n, tuple(t.shape), t.dtype)
        plan.slots.append(Slot(m, off))
        off += m.nbytes
    plan.nbytes = off
    buf = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    return plan, buf


# ---- checks -------------------------------------------------------------------------------
def check_flattened_bucket_reconstruct():
    """Path 1 payload bytes -> SGLang's SafeUnpickler + FlattenedTensorBucket: exact tensors,
    mixed dtypes, 256-byte-aligned offsets with garbage padding."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    _, named = trainer_export("tiny-qwen3-moe")
    named = (
        named[:6]
        + [("extra.fp32", torch.randn(3, 5)), ("extra.i64", torch.arange(7)), ("extra.f16", torch.randn(9).half())]
        + named[6:]
    )
    eng = adapter(None)
    got = []
    for plan, buf in packed_buckets(named):
        payloads = eng.bucket_payloads(plan, buf)
        assert len(payloads) == 1
        data = MultiprocessingSerializer.deserialize(payloads[0])
        got += FlattenedTensorBucket(
            flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
        ).reconstruct_tensors()
    _assert_same_tensors(got, named)
    # the load_weights CUDA branch builds its own flat buffer per chunk
    data = MultiprocessingSerializer.deserialize(eng.chunk_payloads(named)[0])
    _assert_same_tensors(
        FlattenedTensorBucket(
            flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
        ).reconstruct_tensors(),
        named,
    )


def check_dense_distributed_reconstruct():
    """Path 3: the names/dtypes/shapes the adapter passes -> SGLang's receive-bucket layout
    (FlattenedTensorBucket.empty; in 0.5.10 a bucket of empty tensors); the trainer's dense buffer sliced there
    gives back exact tensors."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    _, named = trainer_export("tiny-qwen3")
    named = (
        [("extra.f64", torch.randn(5, dtype=torch.float64))]
        + named
        + [("extra.i32", torch.arange(3, dtype=torch.int32))]
    )
    plan, buf = dense_plan(named)
    rec = SimpleNamespace(update_weights_from_distributed=lambda **kw: (rec.kw.update(kw), (True, "ok"))[1], kw={})
    eng = adapter(rec)
    eng._update_group = "g"
    eng.receive_bucket_distributed(plan)
    if hasattr(FlattenedTensorBucket, "empty"):  # 0.5.2x
        bucket = FlattenedTensorBucket.empty(rec.kw["names"], rec.kw["dtypes"], rec.kw["shapes"], "cpu")
    else:  # 0.5.10's ModelRunner._update_bucketed_weights_from_distributed allocates this way
        bucket = FlattenedTensorBucket(
            named_tensors=[
                (n, torch.empty(sh, dtype=getattr(torch, dt)))
                for n, dt, sh in zip(rec.kw["names"], rec.kw["dtypes"], rec.kw["shapes"])
            ]
        )
    assert bucket.get_flattened_tensor().numel() == buf.numel()
    bucket.get_flattened_tensor().copy_(buf)
    _assert_same_tensors(bucket.reconstruct_tensors(), named)


def _assert_same_tensors(got, want):
    assert [n for n, _ in got] == [n for n, _ in want], "names or order differ"
    for (n, g), (_, w) in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{n}: got {g.dtype} {tuple(g.shape)}, sent {w.dtype} {tuple(w.shape)}"
        )
        assert torch.equal(g, w), f"{n}: values differ"


def check_ipc_payload_safe_unpickle():
    """Path 2: the payload built from the trainer's CudaIpcHandle passes SGLang's SafeUnpickler
    and SGLang's patched rebuild (GPU UUID -> index) calls torch's rebuild_cuda_tensor with
    exactly its 15 arguments; a CPU stand-in for that one CUDA call returns the bucket bytes,
    and SGLang loads them into the model."""
    import inspect

    from torch.multiprocessing import reductions

    cfg, named = trainer_export("tiny-qwen2")
    model = _model(cfg)
    side = SglangSide(model)
    eng = adapter(side)
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # as SGLang's scheduler does before deserializing
    sig = inspect.signature(reductions._rebuild_cuda_tensor_original)  # torch's own function
    opened = {}

    def rebuild_cpu(*args):  # stands in for cudaIpcOpenMemHandle only
        bound = sig.bind(*args).arguments
        assert bound["tensor_cls"] is torch.Tensor and bound["storage_cls"] is torch.UntypedStorage
        assert bound["dtype"] is torch.uint8 and bound["tensor_stride"] == (1,) and bound["tensor_offset"] == 0
        assert bound["storage_device"] == 0, f"SGLang mapped the UUID to {bound['storage_device']!r}"
        buf = opened[bound["storage_handle"]]
        assert bound["storage_size_bytes"] == buf.numel() and bound["storage_offset_bytes"] == 96
        assert bound["tensor_size"] == (buf.numel(),) or bound["tensor_size"][0] <= buf.numel()
        return buf[: bound["tensor_size"][0]]

    uuid = "GPU-8e3c-stand-in"
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_properties = lambda d: SimpleNamespace(uuid=uuid)
    real = reductions._rebuild_cuda_tensor_original
    reductions._rebuild_cuda_tensor_original = rebuild_cpu
    for plan, buf in packed_buckets(named):
        handle = SimpleNamespace(
            handle=b"h%04d" % plan.index,
            device_uuid=uuid,
            device=0,
            storage_size=buf.numel(),
            storage_offset=96,
            ref_counter_handle=b"rc",
            ref_counter_offset=0,
            event_handle=b"ev",
            event_sync_required=False,
        )
        opened[bytes(handle.handle)] = buf
        eng.load_ipc_bucket(plan, [handle])
    reductions._rebuild_cuda_tensor_original = real
    assert_model_holds(model, cfg, named)


def _model(cfg):
    return build_model(cfg, EXPORT_DTYPE)


def load_family_path1(family: str):
    """A real sync of `family` over path 1 (the path every SGLang sync takes today): trainer
    export -> our bucket plan + pack -> adapter payloads -> SGLang's receive -> its load_weights."""
    from rollout_svc.engine.sglang_engine import _hf_param_metas

    cfg, named = trainer_export(family)
    # What the sync transaction will accept for this engine (it refuses any other name or shape)
    # is exactly what SGLang's load_weights below turns into every one of its parameters.
    accepted = {n: tuple(m.shape) for n, m in _hf_param_metas(cfg, EXPORT_DTYPE).items()}
    assert accepted == {n: tuple(t.shape) for n, t in named}, (
        f"SglangEngine.param_metas differs from the export: {sorted(set(accepted) ^ {n for n, _ in named})[:6]}"
    )
    model = _model(cfg)
    side = SglangSide(model)
    eng = adapter(side)
    for plan, buf in several_buckets(named):
        eng._send_flattened(eng.bucket_payloads(plan, buf))  # load_bucket's CUDA branch, from a CPU buffer
    assert_model_holds(model, cfg, named)
    assert all(kw["load_format"] == "flattened_bucket" and kw["flush_cache"] is False for _, kw in side.calls)


def load_family_named(family: str):
    """Path 1 with CPU tensors: `load_weights` sends named lists; SGLang serializes them itself."""
    cfg, named = trainer_export(family)
    model = _model(cfg)
    eng = adapter(SglangSide(model))
    eng.load_weights(iter(named))
    assert_model_holds(model, cfg, named)


def load_family_distributed(family: str):
    """Path 3: dense buckets, SGLang's receive_weights_from_distributed + load_weights_from_distributed."""
    cfg, named = trainer_export(family)
    model = _model(cfg)
    side = SglangSide(model)
    eng = adapter(side)
    from rollout_svc.engine.sglang_weights import UpdateGroup

    eng.join_update_group(UpdateGroup("127.0.0.1", 1, 1, 2, "g", backend="gloo"))
    for i in range(0, len(named), 7):
        plan, buf = dense_plan(named[i : i + 7], index=i // 7)
        side.broadcast_source = buf
        eng.receive_bucket_distributed(plan)
    assert_model_holds(model, cfg, named)


CHECKS = {
    "flattened_bucket_reconstruct": check_flattened_bucket_reconstruct,
    "dense_distributed_reconstruct": check_dense_distributed_reconstruct,
    "ipc_payload_safe_unpickle": check_ipc_payload_safe_unpickle,
    **{f"load_weights_bucket[{f}]": (lambda f=f: load_family_path1(f)) for f in FAMILIES},
    "load_weights_named[tiny-qwen3-moe]": lambda: load_family_named("tiny-qwen3-moe"),
    "load_weights_distributed[tiny-qwen3-moe]": lambda: load_family_distributed("tiny-qwen3-moe"),
    "load_weights_distributed[tiny-qwen2-tied]": lambda: load_family_distributed("tiny-qwen2-tied"),
    **DIRECT_CHECKS,
    **EXPORT_CHECKS,
    **COLOCATED_CHECKS,
    **FP8_CHECKS,
}


def main(version: str, only: str = "") -> None:
    """`only`: run the checks whose name contains it (a developer's shortcut; the test runs them all)."""
    activate(version)
    init_tp1()
    results = {}
    for name, fn in CHECKS.items():
        if only not in name:
            continue
        try:
            fn()
            results[name] = "ok"
        except Exception:  # reported per check; the parent test fails with this traceback
            results[name] = traceback.format_exc(limit=-8)
    print(RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
