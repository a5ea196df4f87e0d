"""Build megatron-core GPTModel chunks (local layer spec) that mirror a transformers config.

The model's facts come from its `ModelSpec` (weightsync/model_spec.py); every field that decides the math is taken
from the HF config and checked: anything the rule tables
or this builder do not reproduce exactly (sliding windows, other activations, MLP biases, unknown
RoPE scaling) is refused with a ValueError naming the field, rather than silently diverging.
"""

from __future__ import annotations

import torch

from trainer_svc.actor.megatron.moe import check_moe_supported, moe_config_fields
from trainer_svc.actor.megatron.parallel import Parallelism
from trainer_svc.actor.megatron.rules import Dims, family_features
from weightsync.model_spec import ModelSpec

# Megatron pads the vocabulary so every TP rank's slice is equal and GEMM-friendly (its default).
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    step = VOCAB_DIVISIBLE_BY * tp
    return (vocab_size + step - 1) // step * step


def check_layout(d: Dims, par: Parallelism) -> None:
    if d.num_heads % par.tp:
        raise ValueError(f"num_attention_heads={d.num_heads} is not divisible by TP={par.tp}")
    if d.num_query_groups % par.tp:
        raise ValueError(f"num_key_value_heads={d.num_query_groups} is not divisible by TP={par.tp}")
    if not all(d.moe_layers) and d.ffn_hidden_size % par.tp:
        raise ValueError(f"intermediate_size={d.ffn_hidden_size} is not divisible by TP={par.tp}")
    if d.num_experts:
        if d.num_experts % par.ep:
            raise ValueError(f"num_experts={d.num_experts} is not divisible by EP={par.ep}")
        if d.moe_ffn_hidden_size % par.expert_tp:
            raise ValueError(
                f"moe_intermediate_size={d.moe_ffn_hidden_size} is not divisible by expert TP={par.expert_tp}"
            )
    elif par.ep > 1:
        raise ValueError(f"EP={par.ep} needs a mixture-of-experts model (the HF config has no num_experts)")
    if d.num_layers % (par.pp * par.vpp):
        raise ValueError(f"num_hidden_layers={d.num_layers} is not divisible by PP*VPP={par.pp * par.vpp}")


def _rope(hf_config) -> dict:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("rope_theta is missing from the HF config (rope_parameters.rope_theta)")
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    if rtype == "default":
        return dict(rotary_base=theta)
    if rtype == "llama3":
        # megatron-core's llama3 scaling hard-codes these three; refuse anything else
        fixed = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        for k, want in fixed.items():
            if float(params.get(k, want)) != want:
                raise ValueError(f"rope_parameters.{k}={params.get(k)} is not supported by megatron-core (only {want})")
        return dict(rotary_base=theta, rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
    raise ValueError(f"rope_parameters.rope_type={rtype!r} is not supported (default, llama3)")


def _check_supported(hf_config, features: dict) -> None:
    c = hf_config
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")
    if getattr(c, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by the Megatron backend")
    if getattr(c, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by the Megatron backend")
    if not features["qkv_bias"] and getattr(c, "attention_bias", False):
        raise ValueError(f"attention_bias=True is not supported for model_type={c.model_type!r}")
    check_moe_supported(c, features)


def transformer_config(
    spec: ModelSpec,
    par: Parallelism,
    *,
    params_dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    expert_layout: str = "sequential",
):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    hf_config, d = spec.hf_config, spec.dims
    features = family_features(spec.family)
    _check_supported(hf_config, features)
    check_layout(d, par)
    if expert_layout == "grouped" and params_dtype != torch.bfloat16:
        raise ValueError(f"expert_layout='grouped' (megatron's GroupedMLP) runs in bfloat16 only, not {params_dtype}")
    return TransformerConfig(
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        ffn_hidden_size=d.ffn_hidden_size,
        num_attention_heads=d.num_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.head_dim,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=features["qkv_bias"],
        qk_layernorm=features["qk_norm"],
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # the fused kernels need CUDA / apex; the unfused paths compute the same math
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # CPU init builds each full master weight from the global RNG and slices it, so a seed gives
        # the same model at every TP size
        use_cpu_initialization=True,
        perform_initialization=init_weights,
        mtp_num_layers=d.mtp_layers or None,
        **moe_config_fields(hf_config, features, d.moe_layers, par.ep, par.expert_tp, expert_layout),
    )


def _gpt_model_class(with_mtp: bool):
    from megatron.core.models.gpt import GPTModel

    if not with_mtp:
        return GPTModel

    class GPTModelWithMTP(GPTModel):
        """GPTModel whose logits-only forward (labels=None) works with an MTP block.

        megatron-core 0.16.1's `_postprocess` runs the MTP block and then `labels.clone()` whenever
        mtp_num_layers is set, so a forward without labels (log-probs, logits parity) raises. MTP
        only adds an auxiliary loss computed from labels and leaves the main logits unchanged, so
        without labels the block is skipped: the logits are those of the main model."""

        def _postprocess(self, *args, labels=None, mtp_in_postprocess=None, **kwargs):
            if labels is not None or not mtp_in_postprocess:
                return super()._postprocess(*args, labels=labels, mtp_in_postprocess=mtp_in_postprocess, **kwargs)
            depth, self.config.mtp_num_layers = self.config.mtp_num_layers, None
            try:
                return super()._postprocess(*args, labels=None, mtp_in_postprocess=False, **kwargs)
            finally:
                self.config.mtp_num_layers = depth

    return GPTModelWithMTP


def _layer_spec(cfg, features: dict, vp_stage: int | None):
    """The decoder spec: one local layer spec for a dense model; per-layer dense/MoE specs otherwise."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if not cfg.num_moe_experts:
        return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=features["qk_norm"])
    return get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)


def build_chunks(
    spec: ModelSpec,
    par: Parallelism,
    *,
    seed: int = 0,
    params_dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    expert_layout: str = "sequential",
) -> list:
    """This rank's GPTModel chunks, one per virtual pipeline stage. Parallel state must be initialised."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from trainer_svc.actor.megatron.compat import apply_cpu_compat, apply_megatron_fixes

    apply_cpu_compat()
    apply_megatron_fixes()
    hf_config = spec.hf_config
    features = family_features(spec.family)
    cfg = transformer_config(
        spec, par, params_dtype=params_dtype, init_weights=init_weights, expert_layout=expert_layout
    )
    model_cls = _gpt_model_class(cfg.mtp_num_layers is not None)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    chunks = []
    for vp in range(par.vpp):
        vp_stage = vp if par.vpp > 1 else None
        layer_spec = _layer_spec(cfg, features, vp_stage)
        mtp_spec = (
            get_gpt_mtp_block_spec(cfg, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)
            if cfg.mtp_num_layers
            else None
        )
        chunk = model_cls(
            cfg,
            layer_spec,
            vocab_size=padded_vocab_size(hf_config.vocab_size, par.tp),
            max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=features["tied"],
            position_embedding_type="rope",
            vp_stage=vp_stage,
            mtp_block_spec=mtp_spec,
            **_rope(hf_config),
        )
        if torch.cuda.is_available():
            chunk.cuda()
        chunks.append(chunk)
    return chunks


def named_parameters_global(chunks) -> dict[str, torch.Tensor]:
    """See param_names.py: global layer and expert numbering, every expert layout as sequential."""
    from trainer_svc.actor.megatron.param_names import named_parameters_global as names

    return names(chunks)


def forward_logits(chunks, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits [batch, seq, vocab] for PP=1 (TP vocab shards gathered, padding trimmed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if len(chunks) != 1 or not (chunks[0].pre_process and chunks[0].post_process):
        raise ValueError("forward_logits needs PP=1 (one chunk holding embedding and head)")
    model = chunks[0]
    pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    # eval mode: megatron's MoELayer refuses a training-mode forward at TP>1 without sequence
    # parallelism, which the local spec's torch norms cannot do; dropout is 0, so the math is the same
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids, pos, attention_mask=None)
    finally:
        model.train(was_training)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size]
