"""How a sync whose manifest announces quantized weights (block FP8) meets the engine.

The engine is checked against the model's own tensors (each `X` / `X_scale_inv` pair counts as
`X`), then loads either the pairs as they are, when it runs that quantization itself
(`Engine.loads_quantized(quantization) -> True`: SGLang serving a block-FP8 checkpoint), or `X`
dequantized to the dtype of the engine's parameter (the built-in engine; SGLang serving a 16-bit
model).
"""

from __future__ import annotations

from weightsync.bus.plan import Manifest, TensorMeta
from weightsync.formats.fp8.blocks import is_block_scale
from weightsync.formats.fp8.receive import Dequantizer, logical_metas
from weightsync.formats.fp8.spec import (
    BLOCK_FP8,
    FP8_DTYPE,
    check_supported,
    hf_quantization_config,
)
from weightsync.formats.fp8.warm import warm_dequantize as _warm_dequantize
from weightsync.formats.fp8.warm import warm_dequantize_into_params


def plan_apply(engine, manifest: Manifest) -> tuple[list[TensorMeta], Dequantizer | None]:
    """(the tensors to check against the engine, the dequantizer loads must go through or None).

    Raises ValueError naming the tensor or the setting at fault.
    """
    q = manifest.quantization
    if q is None:
        check_fp8_where_held(engine.param_metas(), manifest.metas(), quantized=False)
        return manifest.metas(), None
    try:
        check_supported(q)
    except ValueError as exc:
        raise ValueError(f"manifest.quantization: {exc}") from None
    metas = logical_metas(manifest.metas())
    if engine.loads_quantized(q):
        check_fp8_where_held(engine.param_metas(), manifest.metas(), quantized=True)
        return metas, None
    return metas, Dequantizer({n: m.dtype for n, m in engine.param_metas().items()})


def check_fp8_where_held(params: dict[str, TensorMeta], metas: list[TensorMeta], quantized: bool) -> None:
    """An engine that holds some parameters in FP8 (SGLang serving a block-FP8 checkpoint) loads the manifest's
    tensors as they are: each of those must arrive as FP8 (with its scale, checked by logical_metas), and no other
    may. A 16-bit weight copied into an FP8 parameter would be cast without a scale, an FP8 one into a 16-bit
    parameter read as a few bits of it. ValueError naming the tensor and the fix."""
    fp8_held = {n for n, m in params.items() if m.dtype == FP8_DTYPE}
    if not fp8_held:
        return
    for m in metas:
        if m.name not in params:
            continue  # a block scale; an unknown name is refused by the prepare's name check, naming it
        held = params[m.name].dtype
        if m.name in fp8_held and m.dtype != FP8_DTYPE:
            raise ValueError(
                f"tensor {m.name}: the engine holds it in block FP8 (it serves a checkpoint with quantization_config "
                f"{dict(hf_quantization_config(BLOCK_FP8))}) but the manifest sends {m.dtype}"
                + ("" if quantized else " (manifest.quantization: none)")
                + ": set the trainer's export_dtype=fp8-block, or serve the model from a 16-bit checkpoint"
            )
        if m.name not in fp8_held and m.dtype == FP8_DTYPE:
            raise ValueError(
                f"tensor {m.name}: the manifest sends it in block FP8 but the engine holds it in {held} (the served "
                f"checkpoint's quantization_config leaves it unquantized): serve a checkpoint written by the same "
                f"trainer's ExportHf with export_dtype=fp8-block, whose quantized tensors are the manifest's"
            )


def write_metas(engine, manifest: Manifest) -> list[TensorMeta | None] | None:
    """Per slot of a quantized manifest (in order over its buckets), what the trainer writes into the
    engine when it writes the sync itself (ipc trainer_writes): each FP8 weight dequantized, as the
    engine's parameter (its dtype, the weight's shape), nothing for a block scale, every other tensor
    as sent. None when the engine does not take the weights dequantized (it loads the FP8 pairs
    itself) or the manifest cannot be applied (its prepare says why)."""
    q = manifest.quantization
    try:
        check_supported(q)
        logical_metas(manifest.metas())  # complete pairs, scales of the weights' shapes
        if engine.loads_quantized(q):
            return None
    except ValueError:
        return None
    dtypes = {n: m.dtype for n, m in engine.param_metas().items()}
    metas = [slot.meta for plan in manifest.buckets for slot in plan.slots]
    fp8 = {m.name for m in metas if m.dtype == FP8_DTYPE}
    out: list[TensorMeta | None] = []
    for m in metas:
        if is_block_scale(m, fp8):
            out.append(None)
        elif m.dtype == FP8_DTYPE:
            if m.name not in dtypes:
                return None  # the prepare refuses the manifest, naming the tensor
            out.append(TensorMeta(m.name, m.shape, dtypes[m.name]))
        else:
            out.append(m)
    return out


def serves_same_quantization(hf_config, quantization) -> bool:
    """Whether a model served from `hf_config` runs `quantization` itself (its loader then takes the
    `X` / `X_scale_inv` pairs as they are): True for a checkpoint with the same block FP8
    `quantization_config`, False for an unquantized one. A checkpoint quantized some other way
    can take neither the pairs nor dequantized weights: ValueError saying what to change.
    """
    qc = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if not qc:
        return False
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    want = hf_quantization_config(quantization)
    got = (qc.get("quant_method"), qc.get("fmt", "e4m3"), list(qc.get("weight_block_size") or []))
    if got == (want["quant_method"], want["fmt"], want["weight_block_size"]):
        return True
    raise ValueError(
        f"the served checkpoint is quantized as quant_method={got[0]!r} fmt={got[1]!r} "
        f"weight_block_size={got[2]}, the trainer sends {want['quant_method']} {want['fmt']} "
        f"blocks of {want['weight_block_size']}: serve a checkpoint quantized that way (ExportHf "
        f"from a trainer with export_dtype=fp8-block writes one) or an unquantized one"
    )


def warm_dequantize(engine, device) -> float:
    """Compile the FP8 dequantize kernel for the engine's parameters on `device` now; seconds it took.

    Whether a trainer will send block FP8 is known only at a sync's prepare, so a rollout that would
    have to dequantize it (its engine does not load the pairs itself) on a GPU compiles at start-up,
    as it does the checksum. 0.0 off-GPU, without triton, or when the engine loads FP8 pairs itself.
    """
    try:
        if engine.loads_quantized(BLOCK_FP8):
            return 0.0
    except ValueError:
        # a checkpoint quantized another way: a block-FP8 sync is refused at its prepare, saying
        # why (plan_apply); nothing is ever dequantized here
        return 0.0
    took = _warm_dequantize(engine.param_metas().values(), device)
    # and the kernel that dequantizes a whole bucket into the parameters (rollout_svc/sync/fp8_fused_write.py)
    return took + warm_dequantize_into_params(device)
