"""Build megatron-core GPTModel chunks (local layer spec) that mirror a transformers config.

Every field that decides the math is taken from the HF config and checked: anything the rule tables
or this builder do not reproduce exactly (sliding windows, other activations, MLP biases, unknown
RoPE scaling) is refused with a ValueError naming the field, rather than silently diverging.
"""
from __future__ import annotations

import torch

from trainer_svc.megatron.parallel import Parallelism
from trainer_svc.megatron.rules import Dims, family_features

# Megatron pads the vocabulary so every TP rank's slice is equal and GEMM-friendly (its default).
VOCAB_DIVISIBLE_BY = 128


def family_of_config(hf_config) -> str:
    from weightsync.models import family_of

    return family_of(hf_config)


def dims_of(hf_config) -> Dims:
    c = hf_config
    heads = c.num_attention_heads
    groups = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    return Dims(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_heads=heads, num_query_groups=groups,
                head_dim=head_dim, ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    step = VOCAB_DIVISIBLE_BY * tp
    return (vocab_size + step - 1) // step * step


def check_layout(d: Dims, par: Parallelism) -> None:
    if d.num_heads % par.tp:
        raise ValueError(f"num_attention_heads={d.num_heads} is not divisible by TP={par.tp}")
    if d.num_query_groups % par.tp:
        raise ValueError(f"num_key_value_heads={d.num_query_groups} is not divisible by TP={par.tp}")
    if d.ffn_hidden_size % par.tp:
        raise ValueError(f"intermediate_size={d.ffn_hidden_size} is not divisible by TP={par.tp}")
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
                raise ValueError(f"rope_parameters.{k}={params.get(k)} is not supported by megatron-core "
                                 f"(only {want})")
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


def transformer_config(hf_config, par: Parallelism, *, params_dtype: torch.dtype = torch.float32,
                       init_weights: bool = True):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    features = family_features(family_of_config(hf_config))
    _check_supported(hf_config, features)
    d = dims_of(hf_config)
    check_layout(d, par)
    return TransformerConfig(
        num_layers=d.num_layers, hidden_size=d.hidden_size, ffn_hidden_size=d.ffn_hidden_size,
        num_attention_heads=d.num_heads, num_query_groups=d.num_query_groups, kv_channels=d.head_dim,
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        pipeline_dtype=params_dtype, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        normalization="RMSNorm", layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=features["qkv_bias"], qk_layernorm=features["qk_norm"],
        attention_dropout=0.0, hidden_dropout=0.0,
        # the fused kernels need CUDA / apex; the unfused paths compute the same math
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        # CPU init builds each full master weight from the global RNG and slices it, so a seed gives
        # the same model at every TP size
        use_cpu_initialization=True, perform_initialization=init_weights,
    )


def build_chunks(hf_config, par: Parallelism, *, seed: int = 0, params_dtype: torch.dtype = torch.float32,
                 init_weights: bool = True) -> list:
    """This rank's GPTModel chunks, one per virtual pipeline stage. Parallel state must be initialised."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from trainer_svc.megatron.compat import apply_cpu_compat

    apply_cpu_compat()
    features = family_features(family_of_config(hf_config))
    cfg = transformer_config(hf_config, par, params_dtype=params_dtype, init_weights=init_weights)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=features["qk_norm"])
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    chunks = []
    for vp in range(par.vpp):
        vp_stage = vp if par.vpp > 1 else None
        chunk = GPTModel(
            cfg, spec, vocab_size=padded_vocab_size(hf_config.vocab_size, par.tp),
            max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=features["tied"], position_embedding_type="rope",
            vp_stage=vp_stage, **_rope(hf_config))
        if torch.cuda.is_available():
            chunk.cuda()
        chunks.append(chunk)
    return chunks


def named_parameters_global(chunks) -> dict[str, torch.Tensor]:
    """This rank's parameters keyed by Megatron name with GLOBAL layer numbers (layer.layer_number
    is global and 1-based; the module path's index is local to the chunk)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        local_to_global = {}
        if hasattr(chunk, "decoder"):
            for i, layer in enumerate(chunk.decoder.layers):
                local_to_global[i] = layer.layer_number - 1
        for name, p in chunk.named_parameters():
            if name.startswith("decoder.layers."):
                _, _, idx, rest = name.split(".", 3)
                name = f"decoder.layers.{local_to_global[int(idx)]}.{rest}"
            out[name] = p
    return out


def forward_logits(chunks, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits [batch, seq, vocab] for PP=1 (TP vocab shards gathered, padding trimmed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if len(chunks) != 1 or not (chunks[0].pre_process and chunks[0].post_process):
        raise ValueError("forward_logits needs PP=1 (one chunk holding embedding and head)")
    model = chunks[0]
    pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    logits = model(input_ids, pos, attention_mask=None)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size]
