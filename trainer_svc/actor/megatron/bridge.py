"""Converter backends: who turns the Megatron model into HF-named tensors (and back).

`builtin` is the rule tables in `rules/` with `export.py` / `load.py`, the default. `mbridge` and
`megatron-bridge` hand the same job to those packages when installed (`converter` in the trainer
config). A bridge streams in its own order and with its own habits (every rank gets every tensor,
a tied model may yield the head twice or as `lm_head.weight`, the vocabulary may stay padded), so
this module puts one contract around any bridge:

- `plan`: at start-up, one export through the bridge records the names and shapes it yields, in
  its order, and checks them against the built-in plan (which is checked against transformers'
  own model): the same set of tensors, the same shapes, or the trainer refuses to start. That list
  becomes `export_metas()`, so the manifest's order is the bridge's order and nothing is buffered.
- `export`: each later export is checked against that plan tensor by tensor and cast to the
  export dtype. On a mismatch the bridge's stream is still drained before raising, because the
  other ranks are inside the same collectives.

The bridge itself is imported only by `make_converter`, never by importing this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from trainer_svc.bridge_contract import CONTRACTS, BridgeUnavailable, contract_for, require_bridge
from weightsync.bus.plan import TensorMeta

log = logging.getLogger(__name__)

BUILTIN = "builtin"
CONVERTERS = (BUILTIN, *CONTRACTS)
#: our model family (rule table, without "-tied") -> the HF model_type a bridge registers it under
BRIDGE_FAMILIES = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3"}


def _drain(it: Iterator) -> None:
    for _ in it:
        pass


class BridgeConverter:
    """One bridge adapter (an object with `export(chunks)` and `load(chunks, path)`) behind the
    actor's export/load. Every method is collective: call it on every rank."""

    def __init__(self, name: str, adapter, hf_config, padded_vocab: int):
        self.name = name
        self.adapter = adapter
        self.vocab_size = int(hf_config.vocab_size)
        self.padded_vocab = padded_vocab
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))

    def _normalised(self, chunks, shapes: dict[str, tuple[int, ...]], problems: list[str]):
        """The bridge's stream in HF terms: the tied head's extra copies dropped, padded vocabulary
        rows trimmed. Names outside `shapes` are recorded in `problems` and skipped."""
        seen: set[str] = set()
        for name, t in self.adapter.export(chunks):
            if name in seen:
                # a tied model at PP>1 holds a copy of the embedding as the last stage's head; the
                # bridge maps it to the embedding's name again. Megatron keeps the copies equal.
                continue
            if name not in shapes:
                if self.tied and name == "lm_head.weight":
                    continue  # transformers ties it to model.embed_tokens.weight; never sent
                problems.append(
                    f"tensor {name}: yielded by converter {self.name}, but the transformers model has no such tensor"
                )
                continue
            seen.add(name)
            want = shapes[name]
            if (
                t.dim() == len(want)
                and t.shape[0] == self.padded_vocab
                and want[0] == self.vocab_size
                and tuple(t.shape[1:]) == tuple(want[1:])
            ):
                t = t[: self.vocab_size]
            yield name, t

    def plan(self, chunks, reference: list[TensorMeta]) -> list[TensorMeta]:
        """Export once, keep names and shapes in the bridge's order, check them against `reference`
        (the built-in plan: what transformers' model holds). Collective."""
        shapes = {m.name: tuple(m.shape) for m in reference}
        dtype = {m.name: m.dtype for m in reference}
        problems: list[str] = []
        order: list[TensorMeta] = []
        for name, t in self._normalised(chunks, shapes, problems):
            if tuple(t.shape) != shapes[name]:
                problems.append(
                    f"tensor {name}: converter {self.name} yields shape {tuple(t.shape)}, transformers "
                    f"expects {shapes[name]}"
                )
            order.append(TensorMeta(name, shapes[name], dtype[name]))
        missing = [m.name for m in reference if m.name not in {o.name for o in order}]
        if missing:
            problems.append(f"tensor {missing[0]}: converter {self.name} does not yield it ({len(missing)} missing)")
        if problems:
            raise ValueError(
                f"converter={self.name!r} does not reproduce the transformers model: "
                + "; ".join(problems[:5])
                + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
                + ". Use converter=builtin"
            )
        log.info("converter %s: %d tensors planned in the bridge's order", self.name, len(order))
        return order

    def export(self, chunks, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) in `metas` order, cast to each meta's dtype. Collective; every rank
        yields (only the bus sender uses them)."""
        problems: list[str] = []
        it = self._normalised(chunks, {m.name: tuple(m.shape) for m in metas}, problems)
        i = 0
        try:
            for name, t in it:
                m = metas[i] if i < len(metas) else None
                if m is None or m.name != name or tuple(t.shape) != tuple(m.shape):
                    want = f"{m.name} {tuple(m.shape)}" if m else "nothing more"
                    problems.append(
                        f"converter {self.name} yielded {name} {tuple(t.shape)} at position {i}, "
                        f"the plan expects {want}"
                    )
                    break
                if i == len(metas) - 1:
                    # run the bridge to its end before the last tensor leaves: a consumer that stops
                    # pulling once it has everything (hf_writer) must not leave the other ranks
                    # inside the collectives of a trailing tied-head copy
                    extra = [n for n, _ in it]
                    if extra:
                        problems.append(
                            f"converter {self.name} yielded {extra[0]} after the last planned tensor "
                            f"({len(extra)} extra)"
                        )
                    if problems:
                        break
                yield name, t.detach().to(m.dtype)
                i += 1
        finally:
            # finish the bridge's collectives whatever happened here (an error, an early close)
            _drain(it)
        if not problems and i != len(metas):
            problems.append(
                f"converter {self.name} stopped after {i} of {len(metas)} tensors (next expected: {metas[i].name})"
            )
        if problems:
            raise ValueError("; ".join(problems))

    def load(self, chunks, path: str) -> None:
        self.adapter.load(chunks, str(path))


def check_converter_name(name: str) -> str:
    if name not in CONVERTERS:
        raise ValueError(f"converter={name!r} is not one of {', '.join(CONVERTERS)}")
    return name


def make_converter(name: str, spec, par, params_dtype: torch.dtype) -> BridgeConverter | None:
    """None for the built-in rules; otherwise the bridge for `spec` (a ModelSpec), imported and checked
    against its pinned API. Call after the parallel state is initialised (a bridge reads it when built)."""
    if check_converter_name(name) == BUILTIN:
        return None
    hf_config, family = spec.hf_config, spec.family
    base = family[: -len("-tied")] if family.endswith("-tied") else family
    if base not in BRIDGE_FAMILIES:
        raise ValueError(
            f"converter={name!r} supports the families {', '.join(sorted(BRIDGE_FAMILIES))} "
            f"(and their -tied variants), not {family!r}; use converter=builtin"
        )
    if getattr(par, "ep", 1) > 1:
        raise ValueError(f"converter={name!r} is wired for dense models only (EP={par.ep}); use converter=builtin")
    root = require_bridge(name)
    from trainer_svc.actor.megatron.model import padded_vocab_size

    if name == "mbridge":
        from trainer_svc.actor.megatron.bridge_mbridge import MbridgeAdapter

        adapter = MbridgeAdapter(root, hf_config, par.tp, params_dtype)
    else:
        from trainer_svc.actor.megatron.bridge_megatron import MegatronBridgeAdapter

        adapter = MegatronBridgeAdapter(root, hf_config)
    log.info("converter %s (pinned %s) for family %s", name, contract_for(name).pinned, family)
    return BridgeConverter(name, adapter, hf_config, padded_vocab_size(hf_config.vocab_size, par.tp))


__all__ = [
    "BUILTIN",
    "CONVERTERS",
    "BRIDGE_FAMILIES",
    "BridgeConverter",
    "BridgeUnavailable",
    "check_converter_name",
    "make_converter",
]
