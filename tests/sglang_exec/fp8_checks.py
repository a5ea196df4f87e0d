"""Block-FP8 syncs into an SGLang serving a block-FP8 checkpoint (issue 47 item 4; rollout_svc/engine/sglang_fp8.py),
through SGLang's own code (exec_checks.py's process): Qwen2ForCausalLM built with the checkpoint's
`quantization_config` (SGLang's Fp8Config: every linear layer an Fp8LinearMethod with a float8_e4m3fn `weight`
and a float32 `weight_scale_inv` per 128x128 block), `update_weights_from_tensor` with our load format, and
Qwen2's `load_weights`.

The sync is the trainer's `fp8-block` export (weightsync/formats/fp8/export.py) of a transformers model, packed
into small buckets. Two syncs: the first learns the slot tables through SGLang's loader, the second is written by
them (one copy-and-checksum pass); after each every SGLang parameter holds, byte for byte, the exported FP8 weights
and scales (fused q/k/v and gate/up stacked along the output dimension) and the 16-bit tensors, equals a second
model SGLang's own flattened-bucket path loaded, and each bucket's reported checksum is the bucket's.
"""

from __future__ import annotations

import torch

from tests.sglang_exec.direct_checks import direct_adapter, register_loader
from tests.sglang_exec.sglang_side import SglangSide

#: a Qwen2 whose fused parts are whole 128-row blocks (q 256, k 128, v 128; gate 384, up 384), as SGLang requires
FP8_QWEN2 = dict(
    vocab_size=320,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
#: parameters SGLang's FP8 config adds that no checkpoint of this model carries (RadixAttention's KV-cache scales,
#: set by SGLang, not synced by anyone)
KV_CACHE_SCALES = (".attn.k_scale", ".attn.v_scale")


def fp8_config(quantized: bool = True, **shape):
    from transformers import AutoConfig

    from weightsync.formats.fp8.spec import BLOCK_FP8, hf_quantization_config

    kw = dict(FP8_QWEN2, **shape)
    if quantized:
        kw["quantization_config"] = hf_quantization_config(BLOCK_FP8)
    return AutoConfig.for_model("qwen2", **kw)


def fp8_export(seed: int) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    """(the served checkpoint's config, the tensors a block-FP8 sync carries in the trainer's order and names)."""
    from trainer_svc.actor.hf.actor import HfActor
    from trainer_svc.actor.megatron.hf_meta import build_spec
    from trainer_svc.actor.megatron.hf_meta import export_metas as megatron_metas
    from weightsync.formats.fp8.export import export_tensors

    plain = fp8_config(quantized=False)
    state = dict(HfActor(plain, seed=seed).export_tensors())
    order = megatron_metas(build_spec(plain), torch.float32)
    return fp8_config(), list(export_tensors((m.name, state[m.name].float()) for m in order))


def fp8_model(cfg) -> torch.nn.Module:
    """SGLang's Qwen2 with the checkpoint's FP8 config; every synced parameter's bytes NaN (0x7f is NaN in e4m3)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen2ForCausalLM(cfg, quant_config=Fp8Config.from_config(dict(cfg.quantization_config)))
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(KV_CACHE_SCALES):
                continue
            if p.dtype == torch.float8_e4m3fn:
                p.data.view(torch.uint8).fill_(0x7F)
            else:
                p.fill_(float("nan"))
    return model


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _synced(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not n.endswith(KV_CACHE_SCALES)}


def assert_holds_the_export(model, cfg, named) -> None:
    """Every synced SGLang parameter is, byte for byte and in its dtype, what the exported tensors imply."""
    from tests.sglang_exec.exec_checks import expected_sglang_params

    exp = expected_sglang_params(cfg, dict(named))
    params = _synced(model)
    assert set(params) == set(exp), f"unmatched: {sorted(set(params) ^ set(exp))[:6]}"
    fp8 = 0
    for name, p in params.items():
        want = exp[name]
        assert p.dtype == want.dtype and p.shape == want.shape, (
            f"{name}: SGLang holds {p.dtype} {tuple(p.shape)}, the export implies {want.dtype} {tuple(want.shape)}"
        )
        assert torch.equal(_bytes(p), _bytes(want)), f"{name}: SGLang's bytes differ from the trainer's export"
        fp8 += p.dtype == torch.float8_e4m3fn
    assert fp8 == 4 * cfg.num_hidden_layers, f"{fp8} FP8 parameters: SGLang did not build block-FP8 layers"


def check_two_fp8_syncs() -> None:
    from rollout_svc.engine import sglang_loader as sl
    from rollout_svc.engine.sglang_engine import _hf_param_metas
    from rollout_svc.engine.sglang_fp8 import served_metas
    from tests.sglang_exec.exec_checks import packed_buckets
    from weightsync.bus.copy.checksum import bucket_checksum

    for seed, want in ((3, sl.LEARNED), (4, sl.BY_TABLE)):
        cfg, named = fp8_export(seed)
        if seed == 3:
            model = fp8_model(cfg)
            side = SglangSide(model)
            register_loader(side)
            eng = direct_adapter(side)
            # the engine declares FP8 exactly the weights SGLang holds in FP8 (the prepare compares the manifest)
            served = served_metas(_hf_param_metas(cfg, torch.bfloat16), cfg)
            declared = {n for n, m in served.items() if m.dtype == torch.float8_e4m3fn}
            assert declared == {n for n, t in named if t.dtype == torch.float8_e4m3fn}, "FP8 sets differ"
        ref = fp8_model(cfg)
        ref_eng = direct_adapter(SglangSide(ref))
        buckets = packed_buckets(named)
        assert len(buckets) > 2, "the tiny model should span several buckets"
        for plan, buf in buckets:
            got = eng.load_bucket_summed(plan, buf)
            assert got == bucket_checksum(buf[: plan.nbytes]), f"bucket {plan.index}: reported checksum differs"
            assert eng.direct_how[plan.index] == want, (
                f"bucket {plan.index} ({[s.meta.name for s in plan.slots][:3]}...): written by "
                f"{eng.direct_how[plan.index]}, expected {want}; the worker's log says why"
            )
            ref_eng._send_flattened(ref_eng.bucket_payloads(plan, buf))  # SGLang's own path
        assert_holds_the_export(model, cfg, named)
        mine, theirs = _synced(model), _synced(ref)
        for n, t in theirs.items():
            assert torch.equal(_bytes(mine[n]), _bytes(t)), f"{n}: our loader's bytes differ from SGLang's loader's"


def check_prepare_refuses_what_sglang_does_not_hold() -> None:
    """The adapter, serving the FP8 checkpoint, through the real transaction's prepare: the trainer's fp8-block
    manifest is taken as it is (no dequantizer); a 16-bit manifest, and one FP8 weight sent 16-bit, are refused
    naming the tensor and the fix."""
    from rollout_svc.engine.sglang_engine import _hf_param_metas
    from rollout_svc.engine.sglang_fp8 import served_metas
    from rollout_svc.sync.transaction import SyncError, SyncTransaction
    from tests.sglang_exec.exec_checks import adapter
    from weightsync.bus.plan import TensorMeta, make_manifest
    from weightsync.formats.fp8.spec import BLOCK_FP8

    cfg, named = fp8_export(3)
    eng = adapter(None)
    eng._hf_config, eng._metas = cfg, served_metas(_hf_param_metas(cfg, torch.bfloat16), cfg)
    tx = SyncTransaction(eng)

    def manifest(metas, sync_id, quantization=BLOCK_FP8):
        return make_manifest(metas, version=1, sync_id=sync_id, bucket_bytes=16 << 10, quantization=quantization)

    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
    assert tx.validate(manifest(metas, "fp8")) is None, "SGLang serving FP8 should take the pairs as they are"
    bf16 = [
        TensorMeta(n, m.shape, torch.bfloat16) for n, m in _hf_param_metas(fp8_config(False), torch.bfloat16).items()
    ]
    for bad, sync_id, q in (
        (bf16, "bf16", None),
        (
            [
                TensorMeta(m.name, m.shape, torch.bfloat16) if m.name.endswith("1.mlp.down_proj.weight") else m
                for m in metas
                if not m.name.endswith("1.mlp.down_proj.weight_scale_inv")
            ],
            "one-16-bit",
            BLOCK_FP8,
        ),
    ):
        try:
            tx.validate(manifest(bad, sync_id, q))
        except SyncError as exc:
            msg = str(exc)
        else:
            raise AssertionError(f"manifest {sync_id} was accepted by an SGLang serving block FP8")
        assert "the engine holds it in block FP8" in msg and "export_dtype=fp8-block" in msg, msg
    assert "model.layers.1.mlp.down_proj.weight" in msg, msg


def check_block_alignment_as_sglang() -> None:
    """Our check before SGLang starts refuses what SGLang's own Fp8LinearMethod refuses when it builds the layer
    (a fused part of 64 rows), and passes what it builds."""
    from rollout_svc.engine.sglang_engine import _hf_param_metas
    from rollout_svc.engine.sglang_fp8 import check_block_aligned, served_metas

    for heads, ok in ((2, True), (4, False)):  # k/v of one head: 128 rows, or 64
        cfg = fp8_config(num_attention_heads=heads)
        metas = served_metas(_hf_param_metas(cfg, torch.bfloat16), cfg)
        try:
            fp8_model(cfg)
            sglang_error = ""
        except ValueError as exc:
            sglang_error = str(exc)
        try:
            check_block_aligned(metas, cfg, 1)
            ours = ""
        except ValueError as exc:
            ours = str(exc)
        assert bool(sglang_error) != ok and bool(ours) != ok, f"{heads} heads: SGLang {sglang_error!r}, ours {ours!r}"
        assert ok or "k_proj.weight: 64 rows" in ours, ours


def check_rollout_writes_fp8_through_the_table() -> None:
    """Over NCCL or TCP (rollout_svc/engine/sglang_mapped.py): after a learning sync, the table SGLang's worker
    exports covers the FP8 layout byte for byte (each e4m3 weight and float32 scale where SGLang's Fp8LinearMethod
    holds them), rollout-svc maps it, and the in-place apply's copy-and-checksum writes a second sync's buckets
    into SGLang's parameters with no SGLang call: the same bytes as SGLang's own loader, the buckets' checksums."""
    from rollout_svc.engine import sglang_export_worker
    from tests.sglang_exec.exec_checks import packed_buckets
    from tests.sglang_exec.export_checks import _FakeIpc
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.copy.verified_copy import copy_into

    ipc = _FakeIpc()
    sglang_export_worker.share_storage = ipc.share
    try:
        cfg, named = fp8_export(3)
        model = fp8_model(cfg)
        side = SglangSide(model)
        register_loader(side)
        eng = direct_adapter(side)
        eng.open_allocation = ipc.open
        eng.sync_layouts = {}  # (begin_apply)
        for plan, buf in packed_buckets(named):
            eng.load_bucket_summed(plan, buf)
        eng.export_after_sync()  # (end_apply)
        cfg, named = fp8_export(4)
        buckets = packed_buckets(named)
        calls = len(side.calls)
        eng.writing_in_place = True  # (begin_apply)
        for plan, buf in buckets:
            params = eng.writable_params([slot.meta for slot in plan.slots])
            assert params is not None, f"bucket {plan.index}: the mapped table does not cover it"
            assert copy_into(plan, buf, params) == bucket_checksum(buf[: plan.nbytes]), f"bucket {plan.index}"
        assert len(side.calls) == calls, "SGLang was called while rollout-svc wrote"
        assert_holds_the_export(model, cfg, named)
    finally:
        sglang_export_worker.share_storage = None


def check_fp8_syncs_through_the_transaction() -> None:
    """The rollout's own transaction (in-place apply) over the adapter, SGLang's receive code behind it: prepare of
    the trainer's fp8-block manifest (as it crosses the wire), every bucket with the trainer's checksum, commit;
    twice. The pairs reach SGLang as they are (no dequantizer), the second sync by the slot table, and SGLang then
    serves the committed version's bytes."""
    from types import SimpleNamespace

    from rollout_svc.engine import sglang_loader as sl
    from rollout_svc.engine.sglang_engine import _hf_param_metas
    from rollout_svc.engine.sglang_fp8 import served_metas
    from rollout_svc.sync.transaction import SyncTransaction
    from tests.sglang_exec.exec_checks import BUCKET_BYTES
    from weightsync.bus.copy.checksum import ALGO, bucket_checksum
    from weightsync.bus.pack import alloc_buffer, pack_bucket
    from weightsync.bus.plan import TensorMeta, make_manifest, manifest_from_proto, manifest_to_proto
    from weightsync.formats.fp8.spec import BLOCK_FP8

    cfg, _ = fp8_export(3)
    model = fp8_model(cfg)
    side = SglangSide(model)
    side.tokenizer_manager = SimpleNamespace()  # no pause/continue here: begin_apply skips them
    side.flush_cache = lambda: (side.calls.append(("flush_cache", {})), True)[1]
    register_loader(side)
    eng = direct_adapter(side)
    eng._hf_config, eng._metas = cfg, served_metas(_hf_param_metas(cfg, torch.bfloat16), cfg)
    tx = SyncTransaction(eng, "inplace")
    for version in (1, 2):
        _, named = fp8_export(2 + version)
        metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
        m = make_manifest(
            metas,
            version=version,
            sync_id=f"s{version}",
            bucket_bytes=BUCKET_BYTES,
            checksum_algo=ALGO,
            quantization=BLOCK_FP8,
        )
        m = manifest_from_proto(manifest_to_proto(m))  # as the rollout receives it
        state, bufs = dict(named), []
        for b in m.buckets:
            buf = alloc_buffer(b.nbytes)
            pack_bucket(b, [(slot.meta.name, state[slot.meta.name]) for slot in b.slots], buf)
            bufs.append(buf)
        sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
        tx.prepare(m, timeout=60)
        assert tx._pending.dequantizer is None, "an FP8 SGLang should take the pairs as they are"
        for i, buf in enumerate(bufs):
            tx.consume_bucket(m.sync_id, i, buf, sums[i])
        tx.commit(m.sync_id, version, sums)
        assert tx.version == version, f"version {tx.version} after committing {version}"
        assert_holds_the_export(model, cfg, named)
    assert set(eng.direct_how.values()) == {sl.BY_TABLE}, f"the second sync was written by {eng.direct_how}"
    assert ("flush_cache", {}) in side.calls


CHECKS = {
    "fp8_block_two_syncs[tiny-qwen2-fp8]": check_two_fp8_syncs,
    "fp8_block_prepare_refusals": check_prepare_refuses_what_sglang_does_not_hold,
    "fp8_block_alignment_as_sglang": check_block_alignment_as_sglang,
    "fp8_block_rollout_writes_through_table": check_rollout_writes_fp8_through_the_table,
    "fp8_block_syncs_through_the_transaction": check_fp8_syncs_through_the_transaction,
}
