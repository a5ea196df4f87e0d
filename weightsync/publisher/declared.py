"""What a Publisher publishes: the declared tensors (HF name, shape, dtype), and each sync's tensors checked
against them.

A model is declared once, from an HF config (a directory holding config.json, or a transformers
config object: names and shapes come from the transformers model built on the meta device, so no
weight is allocated; a tied lm_head is not published, as the HF checkpoint has none) or from a
dict `{name: (shape, dtype)}` where no HF config exists. `DeclaredSource` is the actor the sync
orchestrator exports (trainer_svc/actor/base.py's contract): it holds one sync's tensors, in
declared order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync.bus.plan import TensorMeta
from weightsync.publisher.source import WeightSource
from weightsync.publisher.streamable import check_streamable


def _dtype(value, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, str(value).removeprefix("torch."), None)  # foreign: a dtype name of torch
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{where}: dtype {value!r} is not a torch dtype (e.g. torch.bfloat16 or 'bfloat16')")
    return dt


def metas_from_dict(spec: Mapping[str, tuple]) -> list[TensorMeta]:
    """`{HF name: (shape, dtype)}` in publishing order."""
    if not spec:
        raise ValueError("model: the dict of tensors is empty; give {HF name: (shape, dtype)}")
    out = []
    for name, value in spec.items():
        try:
            shape, dtype = value
        except (TypeError, ValueError):
            raise ValueError(
                f"model[{name!r}] = {value!r}: give (shape, dtype), e.g. ((4096, 4096), torch.bfloat16)"
            ) from None
        out.append(TensorMeta(name, tuple(int(d) for d in shape), _dtype(dtype, f"model[{name!r}]")))
    return out


def hf_config(model):
    """A transformers config from a directory (config.json) or a config object."""
    if isinstance(model, (str, Path)):
        if not (Path(model) / "config.json").is_file():
            raise ValueError(
                f"model={str(model)!r}: no config.json there; give an HF model directory, a transformers "
                "config or a dict {name: (shape, dtype)}"
            )
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model))
    return model


def metas_from_hf_config(config, dtype=None) -> list[TensorMeta]:
    """The HF checkpoint's tensors of `config`'s causal LM (a tied lm_head left out), in state-dict order.
    `dtype`: the dtype the tensors are given in; default the config's torch_dtype, else float32."""
    from transformers import AutoModelForCausalLM

    # `dtype` on recent transformers, `torch_dtype` (deprecated there) on older ones
    given = getattr(config, "dtype", None) or vars(config).get("torch_dtype")  # foreign: an HF config
    dt = _dtype(dtype or given or torch.float32, "dtype")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))  # foreign: an HF config
    return [
        TensorMeta(n, tuple(t.shape), dt) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")
    ]


@dataclass(frozen=True)
class DeclaredModel:
    """A Publisher's model: an HF model directory, a transformers config or a dict {HF name: (shape,
    dtype)}; `dtype`: the dtype HF-config tensors are given in (default the config's torch_dtype,
    else float32); `family`: the rollouts' model family (default from the HF config; "" for a dict)."""

    model: Any
    dtype: Any = None
    family: str | None = None

    def metas(self) -> tuple[list[TensorMeta], str]:
        """(the declared tensors, the model family)."""
        if isinstance(self.model, Mapping):
            return metas_from_dict(self.model), self.family or ""
        from weightsync.model_spec import family_of

        config = hf_config(self.model)
        fam = self.family if self.family is not None else family_of(config)
        return metas_from_hf_config(config, self.dtype), fam


class DeclaredSource(WeightSource):
    """The sync orchestrator's actor for a Publisher: declared metas, the tensors of the sync at hand."""

    def __init__(self, metas: list[TensorMeta], family: str, device: torch.device):
        self._metas = metas
        self._by_name = {m.name: m for m in metas}
        self.family = family
        self.device = device
        self.version = 0
        self.lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] | None = None

    # ---- the actor contract (trainer_svc/actor/base.py) ---------------------------------
    def export_metas(self) -> list[TensorMeta]:
        return self._metas

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        held = self._tensors
        if held is None:
            raise RuntimeError(
                "this publisher holds no tensors outside Publisher.sync() (snapshot=False): a rollout that "
                "registered since is synced by the next Publisher.sync()"
            )
        for m in self._metas:
            yield m.name, held[m.name]

    @property
    def publishable(self) -> bool:
        """Whether there are tensors to send now (read by the catch-up of a newly registered rollout)."""
        return self._tensors is not None

    def num_parameters(self) -> int:
        return sum(_numel(m.shape) for m in self._metas)

    def describe_parallelism(self) -> str:
        return "external process (weightsync.publisher.Publisher)"

    # ---- what Publisher.sync() hands in ------------------------------------------------
    def check(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, complete: bool = True
    ) -> dict[str, torch.Tensor]:
        """The tensors by name, each declared, once, with its shape and dtype, on the export device;
        `complete`: every declared one (False for one rank's share of a collective sync)."""
        got: dict[str, torch.Tensor] = {}
        for name, t in named_tensors:
            meta = self._by_name.get(name)
            if meta is None:
                raise ValueError(f"{name}: not a declared tensor of this publisher's model (declared: {self._some()})")
            if name in got:
                raise ValueError(f"{name}: given twice in one sync")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: a {type(t).__name__}, not a torch.Tensor")
            check_streamable(name, t)  # before its shape: a nested tensor has none
            if tuple(t.shape) != meta.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, declared {meta.shape} (give it in HF layout)")
            if t.dtype != meta.dtype:
                raise ValueError(f"{name}: dtype {t.dtype}, declared {meta.dtype} (cast it, or declare dtype=)")
            if t.device.type != self.device.type:
                raise ValueError(f"{name}: on {t.device}, the publisher exports from {self.device} (device=)")
            got[name] = t.detach()
        missing = [m.name for m in self._metas if m.name not in got] if complete else []
        if missing:
            raise ValueError(
                f"{missing[0]}: declared but not given ({len(missing)} missing); every sync publishes every tensor"
            )
        return got

    def digest(self) -> str:
        """Of the declaration (names, shapes, dtypes in order): the ranks of a collective sync compare it."""
        import hashlib

        text = ";".join(f"{m.name}:{list(m.shape)}:{m.dtype}" for m in self._metas)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def hold(self, tensors: dict[str, torch.Tensor] | None) -> None:
        self._tensors = tensors

    def _some(self) -> str:
        names = [m.name for m in self._metas]
        return ", ".join(names[:3]) + (f", ... {len(names)} in all" if len(names) > 3 else "")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
