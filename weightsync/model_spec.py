"""What a model is, read once from its transformers config: family, dimensions, checkpoint shapes, MTP.

This is the one module that interprets an HF config. A `ModelSpec` is built once per actor (and
once per offline conversion) and handed to everything that needs the model's facts: the rule
tables, the Megatron model builder, export, load and the bridges. Nothing re-derives the
dimensions or the checkpoint shapes from the config afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

#: the multi-token-prediction namings a trainer can publish ("off": the checkpoint's MTP layers are ignored)
MTP_STYLES = ("off", "deepseek", "mimo")
#: what a decoder layer's MLP is (Dims.layer_kind)
DENSE, MOE = "dense", "moe"

_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {}


@dataclass(frozen=True)
class Dims:
    """The shape facts transforms and the export order need, taken from the HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per decoder layer: is its MLP a mixture of experts?
    mtp_layers: int = 0  # multi-token-prediction depths exported (0: MTP off)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    def layer_kind(self, layer: int) -> str:
        return MOE if self.moe_layers and self.moe_layers[layer] else DENSE


def family_of(config: Any) -> str:
    """The rule-table family key of a transformers config."""
    mt = getattr(config, "model_type", "")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if mt == "qwen2":
        return "qwen2-tied" if tied else "qwen2"
    if mt in ("llama", "qwen3", "qwen3_moe", "qwen2_moe"):
        return mt + ("-tied" if tied else "")
    return mt


def check_mtp_style(mtp: str) -> str:
    if mtp not in MTP_STYLES:
        raise ValueError(f"mtp={mtp!r} is not one of {MTP_STYLES}")
    return mtp


def mtp_depth(hf_config, mtp: str) -> int:
    """How many MTP layers to carry: the config's num_nextn_predict_layers when MTP is on."""
    if check_mtp_style(mtp) == "off":
        return 0
    n = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    if n < 1:
        raise ValueError(
            f"mtp={mtp!r} but the HF config has no num_nextn_predict_layers >= 1 (model_type="
            f"{hf_config.model_type!r}); set mtp=off or use a checkpoint with MTP layers"
        )
    return n


def moe_layer_pattern(hf_config) -> tuple[bool, ...]:
    """Which decoder layers are MoE, by the rule Qwen2/Qwen3-MoE's modeling code applies
    (not in mlp_only_layers, and (i + 1) % decoder_sparse_step == 0)."""
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if not experts:
        return ()
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))


def dims_of(hf_config, mtp: str = "off") -> Dims:
    c = hf_config
    heads = c.num_attention_heads
    groups = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    moe_layers = moe_layer_pattern(c)
    return Dims(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        num_experts=int(getattr(c, "num_experts", 0) or 0) if any(moe_layers) else 0,
        moe_ffn_hidden_size=int(getattr(c, "moe_intermediate_size", 0) or 0) if any(moe_layers) else 0,
        moe_layers=moe_layers,
        mtp_layers=mtp_depth(c, mtp),
    )


def checkpoint_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of the checkpoint on disk (what `save_pretrained` writes and
    SGLang's load_weights reads), from a transformers model on the meta device. transformers 5 keeps
    some tensors fused in memory (MoE experts as one `gate_up_proj` [E, 2F, H]) and converts them
    when saving; `revert_weight_conversion` applies that same conversion to the meta state dict."""
    # keyed by the config's JSON so that building two specs of one model builds one meta model
    key = hf_config.to_json_string(use_diff=False)
    if key not in _SHAPES:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        on_disk = revert_weight_conversion(model, model.state_dict())
        _SHAPES.clear()
        _SHAPES[key] = {n: tuple(t.shape) for n, t in on_disk.items()}
    return dict(_SHAPES[key])


@dataclass(frozen=True)
class ModelSpec:
    """A model's facts, computed once: pass this instead of (hf_config, family, mtp)."""

    hf_config: Any
    family: str
    mtp: str
    dims: Dims
    #: HF name -> shape of every tensor published (the checkpoint's, plus MTP layers when mtp is on)
    hf_shapes: dict[str, tuple[int, ...]] = field(compare=False)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @classmethod
    def from_hf(
        cls,
        hf_config,
        mtp: str = "off",
        *,
        family: str | None = None,
        extra_shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]] | None = None,
    ) -> ModelSpec:
        """Read `hf_config` once. `family` overrides the config's own (to check a rule table against
        another model); `extra_shapes(spec)` adds tensors that are not part of the transformers
        model (MTP layers, named by the trainer's rule tables)."""
        spec = cls(
            hf_config, family or family_of(hf_config), mtp, dims_of(hf_config, mtp), checkpoint_shapes(hf_config)
        )
        if extra_shapes is not None:
            spec = replace(spec, hf_shapes={**spec.hf_shapes, **extra_shapes(spec)})
        return spec
