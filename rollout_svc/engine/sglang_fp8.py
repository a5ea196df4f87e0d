"""What an SGLang serving a block-FP8 checkpoint holds, for the sync's checks (issue 47 item 4).

With a config.json whose `quantization_config` is `{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]}` (DeepSeek-V3's spelling), SGLang builds every linear layer with its
`Fp8LinearMethod` (0.5.10 and 0.5.23, `srt/layers/quantization/fp8.py`): a `weight` in float8_e4m3fn and a
float32 `weight_scale_inv`, one per 128x128 block; embeddings, lm_head, norms and biases stay 16-bit. A fused
layer (`qkv_proj`, `gate_up_proj`) stacks its parts' weights and their scales along the output dimension, so each
part must start on a block row: SGLang refuses at load a part (per TP rank) that is not a multiple of 128 rows, and
a row-parallel layer (`o_proj`, `down_proj`) whose input columns per rank are not. The checkpoint's own names
(`q_proj.weight`, `q_proj.weight_scale_inv`) are what its loader routes into those parameters, byte for byte,
which is the trainer's `fp8-block` export: the sync carries the pairs unchanged (rollout_svc/quantized.py).

Here: which of the model's checkpoint tensors SGLang holds in FP8 (`served_metas`: the engine's parameter table
says float8_e4m3fn for them, which the prepare compares with the manifest), and the block alignment checked before
SGLang starts, naming the tensor and the fix instead of SGLang's assertion deep in its model loader.
"""

from __future__ import annotations

import re
from typing import Any

from weightsync.bus.plan import TensorMeta
from weightsync.formats.fp8.export import is_quantized
from weightsync.formats.fp8.spec import BLOCK, BLOCK_FP8, FP8_DTYPE

#: parts of a column-parallel layer (their rows split over TP ranks; fused with their siblings)
_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")
#: row-parallel layers (their input columns split over TP ranks)
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_KV = re.compile(r"\.self_attn\.(k_proj|v_proj)\.weight$")


def quantization_config(hf_config: Any) -> dict | None:
    """The served checkpoint's `quantization_config` as a dict, or None (a 16-bit checkpoint)."""
    qc = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if not qc:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def serves_block_fp8(hf_config: Any) -> bool:
    """True when SGLang serves this checkpoint with block-FP8 linear layers of the scheme the trainer exports."""
    from rollout_svc.quantized import serves_same_quantization

    try:
        return serves_same_quantization(hf_config, BLOCK_FP8)
    except ValueError:  # quantized another way: the prepare of a block-FP8 sync is refused, saying why
        return False


def _ignored(name: str, ignored: list[str]) -> bool:
    # SGLang's is_layer_skipped matches a layer's prefix; the checkpoint name is `<prefix>.weight`
    prefix = name.rsplit(".", 1)[0]
    return any(prefix == p or prefix == f"model.{p}" or prefix.endswith(f".{p}") for p in ignored)


def served_metas(metas: dict[str, TensorMeta], hf_config: Any) -> dict[str, TensorMeta]:
    """The engine's parameter table with float8_e4m3fn for each tensor SGLang holds in block FP8 (a linear
    weight not listed in the checkpoint's `ignored_layers` / `modules_to_not_convert`); `metas` unchanged for
    a checkpoint that is not block FP8."""
    if not serves_block_fp8(hf_config):
        return metas
    qc = quantization_config(hf_config) or {}
    ignored = list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    out = {}
    for name, m in metas.items():
        if is_quantized(name, tuple(m.shape)) and not _ignored(name, ignored):
            m = TensorMeta(m.name, m.shape, FP8_DTYPE)
        out[name] = m
    return out


def check_block_aligned(metas: dict[str, TensorMeta], hf_config: Any, tp_size: int) -> None:
    """ValueError naming the first FP8 tensor whose part of a fused layer (or TP shard) does not start on a
    128-row / 128-column block, where SGLang's Fp8LinearMethod needs it to; nothing for a 16-bit checkpoint."""
    bn, bk = BLOCK
    kv_heads = int(getattr(hf_config, "num_key_value_heads", 0) or 0)
    for name, m in metas.items():
        if m.dtype != FP8_DTYPE or len(m.shape) != 2:
            continue
        rows, cols = int(m.shape[0]), int(m.shape[1])
        if _COLUMN.search(name):
            split = tp_size
            if _KV.search(name) and 0 < kv_heads < tp_size:
                split = kv_heads  # SGLang replicates k/v heads over ranks when there are fewer heads than ranks
            per_rank = rows // split
            if rows % split or per_rank % bn:
                raise ValueError(
                    f"tensor {name}: {rows} rows give {per_rank} per TP rank (tp_size={tp_size}), not a multiple of "
                    f"the {bn}-row FP8 block SGLang's fused block-FP8 layer needs for each part: serve this model "
                    f"from a 16-bit checkpoint (block-FP8 syncs are then dequantized into it) or choose a tp_size "
                    f"that keeps every part block-aligned"
                )
        elif _ROW.search(name) and tp_size > 1 and (cols % tp_size or (cols // tp_size) % bk):
            raise ValueError(
                f"tensor {name}: {cols} input columns give {cols // tp_size} per TP rank (tp_size={tp_size}), not a "
                f"multiple of the {bk}-column FP8 block SGLang's row-parallel block-FP8 layer needs: serve this "
                f"model from a 16-bit checkpoint or choose another tp_size"
            )
