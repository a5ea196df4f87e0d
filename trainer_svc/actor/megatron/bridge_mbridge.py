"""mbridge (pinned 0.15.1) as a converter: `AutoBridge.from_config` → `export_weights(chunks)` /
`load_weights(chunks, dir)`, on the GPTModel chunks the actor built itself.

Three things differ between mbridge's assumptions and our model, and each is adjusted on the
bridge *instance* (never on its classes):

- mbridge's tables name the Transformer Engine layer spec, whose norms live inside the fused
  linears (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`).
  Our local spec has separate modules (`input_layernorm`, `pre_mlp_layernorm`); they get aliases
  that map to whatever HF name mbridge's own table gives the fused name.
- mbridge finds TP-sharded parameters by Megatron's `tensor_model_parallel` / `partition_dim`
  attributes, which megatron-core 0.16.1 sets only when it initialises a weight
  (`perform_initialization=True`); a model built to load HF weights has none, and mbridge would
  export each rank's shard as if it were the whole tensor. They are restored from the owning
  layer's type, the same reading as `train_backend.py`'s grad-norm.
- Vocabulary padding is set up by mbridge's `get_model()`, which we do not call: the divisor and
  both sizes are set to what our builder used (128 x TP).
- `Qwen2Bridge._adjust_mapping_for_shared_weights` rewrites the class-level `_DIRECT_MAPPING`
  for a tied model, so a later untied qwen2/qwen3 bridge in the same process would export the head
  as `model.embed_tokens.weight`. The instance gets its own table with `output_layer.weight`
  mapped for this model's tying.
"""

from __future__ import annotations

import torch

from trainer_svc.bridge_contract import CONTRACTS, BridgeUnavailable, check_instance

# local layer spec name -> the TE spec's fused name in mbridge's tables, and the table holding it
_LOCAL_NORMS = {
    "input_layernorm.weight": ("_ATTENTION_MAPPING", "self_attention.linear_qkv.layer_norm_weight", "_OTHER_MAPPING"),
    "pre_mlp_layernorm.weight": ("_MLP_MAPPING", "mlp.linear_fc1.layer_norm_weight", "_MLP_MAPPING"),
}


def mark_tp_sharded(chunks) -> None:
    """Set the TP attributes megatron-core skipped: vocab-parallel embeddings and column-parallel
    linears are split on dim 0, a row-parallel linear's weight on dim 1. Existing marks are kept."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for chunk in chunks:
        for mod in chunk.modules():
            if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
                dims = {"weight": 0, "bias": 0}
            elif isinstance(mod, RowParallelLinear):
                dims = {"weight": 1}
            else:
                continue
            for name, p in mod.named_parameters(recurse=False):
                if name in dims and not hasattr(p, "tensor_model_parallel"):
                    p.tensor_model_parallel = True
                    p.partition_dim = dims[name]


class MbridgeAdapter:
    def __init__(self, mbridge, hf_config, tp: int, params_dtype: torch.dtype):
        from trainer_svc.actor.megatron.model import VOCAB_DIVISIBLE_BY, padded_vocab_size

        if hf_config.model_type not in mbridge.AutoBridge.list_supported_models():
            raise BridgeUnavailable(
                f"converter='mbridge': mbridge has no bridge for model_type="
                f"{hf_config.model_type!r}; use converter=builtin"
            )
        # dtype matters on load: mbridge casts every HF tensor to it before the TP split
        self.bridge = mbridge.AutoBridge.from_config(
            hf_config, dtype=params_dtype, make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY * tp
        )
        b = self.bridge
        check_instance(CONTRACTS["mbridge"], b)
        b.vocab_size = int(hf_config.vocab_size)
        b.padded_vocab_size = padded_vocab_size(hf_config.vocab_size, tp)
        tables = {
            t: dict(getattr(b, t)) for t in ("_ATTENTION_MAPPING", "_MLP_MAPPING", "_OTHER_MAPPING", "_DIRECT_MAPPING")
        }
        for local, (src_table, fused, dst_table) in _LOCAL_NORMS.items():
            tables[dst_table][local] = list(tables[src_table][fused])
        base_direct = mbridge.core.bridge.Bridge._DIRECT_MAPPING
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        tables["_DIRECT_MAPPING"]["output_layer.weight"] = (
            tables["_DIRECT_MAPPING"]["embedding.word_embeddings.weight"]
            if tied
            else base_direct["output_layer.weight"]
        )
        for t, table in tables.items():
            setattr(b, t, table)

    def export(self, chunks):
        mark_tp_sharded(chunks)
        return self.bridge.export_weights(chunks)

    def load(self, chunks, path: str) -> None:
        mark_tp_sharded(chunks)
        # memory_efficient reads one HF tensor at a time; the default reads a whole chunk's tensors
        # onto TP rank 0 first, a full model copy at PP=1
        with torch.no_grad():
            self.bridge.load_weights(chunks, path, memory_efficient=True)
