"""Multi-token-prediction (MTP) rules: megatron's `mtp.layers.{i}` block under two HF namings.

Megatron's MultiTokenPredictionLayer (transformer/multi_token_prediction.py) holds `enorm` (on the
embedding of token t+k), `hnorm` (on the previous depth's hidden state), `eh_proj` [hidden, 2*hidden]
applied to cat(enorm(emb), hnorm(h)), a `transformer_layer` built from the last decoder layer's spec,
and `final_layernorm` before the output layer; embedding and output layer are the main model's.

* DeepSeek-V3 (also GLM-4.5) checkpoints number the MTP layers after the decoder's:
  `model.layers.{num_hidden_layers + i}.{enorm,hnorm,eh_proj,shared_head.norm}.weight`, the decoder
  layer's own tensors directly under that prefix, and a copy of the embedding and head as
  `embed_tokens` / `shared_head.head` (vLLM deepseek_mtp.py `_rewrite_spec_layer_name`, SGLang
  deepseek_nextn.py). Megatron shares those two, so they are exported as copies and not loaded.
* MiMo: `model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}.weight`
  and the decoder layer under `model.mtp_layers.{i}.`; input_proj reads cat(hidden, embedding), the
  reverse of eh_proj (vLLM / SGLang mimo_mtp.py); the head and embedding are the main model's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from trainer_svc.actor.megatron.rules.base import LAYER, Dims, Rule
from trainer_svc.actor.megatron.rules.transforms import IDENTITY, SWAP_HALVES
from weightsync.model_spec import MTP_STYLES, check_mtp_style  # noqa: F401 (MTP_STYLES re-exported)

M = "mtp.layers.{mtp}."
_PREFIX = {"deepseek": "model.layers.{mtp_layer}.", "mimo": "model.mtp_layers.{mtp}."}


def _as_mtp_layer(rule: Rule, prefix: str) -> Rule:
    """A decoder-layer rule moved into the MTP block's transformer layer."""
    return replace(
        rule,
        megatron=rule.megatron.replace("decoder.layers.{layer}.", M + "transformer_layer."),
        hf=tuple(h.replace("model.layers.{layer}.", prefix) for h in rule.hf),
    )


def mtp_rules(style: str, layer_rules: Sequence[Rule], *, tied: bool) -> tuple[Rule, ...]:
    if check_mtp_style(style) == "off":
        return ()
    p = _PREFIX[style]
    block = [_as_mtp_layer(r, p) for r in layer_rules if r.section == LAYER]
    if style == "deepseek":
        head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
        own = [
            Rule(M + "enorm.weight", (p + "enorm.weight",), IDENTITY),
            Rule(M + "hnorm.weight", (p + "hnorm.weight",), IDENTITY),
            Rule(M + "eh_proj.weight", (p + "eh_proj.weight",), IDENTITY, tp_dim=0),
            Rule(M + "final_layernorm.weight", (p + "shared_head.norm.weight",), IDENTITY),
            Rule(
                "embedding.word_embeddings.weight",
                (p + "embed_tokens.weight",),
                IDENTITY,
                tp_dim=0,
                vocab=True,
                export_only=True,
            ),
            Rule(head, (p + "shared_head.head.weight",), IDENTITY, tp_dim=0, vocab=True, export_only=True),
        ]
    else:
        own = [
            Rule(M + "enorm.weight", (p + "token_layernorm.weight",), IDENTITY),
            Rule(M + "hnorm.weight", (p + "hidden_layernorm.weight",), IDENTITY),
            Rule(M + "eh_proj.weight", (p + "input_proj.weight",), SWAP_HALVES, tp_dim=0),
            Rule(M + "final_layernorm.weight", (p + "final_layernorm.weight",), IDENTITY),
        ]
    return tuple(own[:3] + block + own[3:])


_MTP_NAME = re.compile(r"^model\.(?:layers|mtp_layers)\.\d+\.(?P<suffix>.+)$")
_HIDDEN = {
    "enorm.weight",
    "hnorm.weight",
    "shared_head.norm.weight",
    "token_layernorm.weight",
    "hidden_layernorm.weight",
    "final_layernorm.weight",
}
_PROJ = {"eh_proj.weight", "input_proj.weight"}
_VOCAB = {"embed_tokens.weight", "shared_head.head.weight"}


def mtp_hf_shape(name: str, d: Dims, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of an MTP tensor: its own norms/projection from the dims, the copied embedding/head
    like the model's, anything else like the same tensor of the last decoder layer."""
    m = _MTP_NAME.match(name)
    if not m:
        raise ValueError(f"tensor {name}: not an MTP layer name")
    suffix = m["suffix"]
    if suffix in _HIDDEN:
        return (d.hidden_size,)
    if suffix in _PROJ:
        return (d.hidden_size, 2 * d.hidden_size)
    if suffix in _VOCAB:
        return shapes["model.embed_tokens.weight"]
    like = f"model.layers.{d.num_layers - 1}.{suffix}"
    if like not in shapes:
        raise ValueError(f"tensor {name}: no {like} in the model to take its shape from")
    return shapes[like]
