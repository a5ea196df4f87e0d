"""Checkpoint names for a transformers model whose in-memory parameters differ from its checkpoint.

transformers 5 keeps some tensors fused in memory — an MoE layer's experts as one `gate_up_proj`
[E, 2F, H] and one `down_proj` [E, H, F] — and splits them when saving. The bus speaks checkpoint
names (what `save_pretrained` writes and SGLang's `load_weights` reads), so an engine holding such a
model must know, for every checkpoint tensor, which elements of which fused parameter it is. Rather
than re-deriving each model's conversion, this runs transformers' own save-side conversion
(`revert_weight_conversion`) once on the fused parameters filled with their global element indices:
every checkpoint tensor it returns is then the exact index map into its parameter (float64 holds
integers exactly up to 2**53). A model without fused parameters costs nothing: its names are its
parameters' names.
"""

from __future__ import annotations

import torch


class SplitParam:
    """One checkpoint tensor that lives inside a fused parameter, at `index` (flat, in its shape)."""

    def __init__(self, fused: torch.nn.Parameter, index: torch.Tensor):
        self.fused, self.index = fused, index
        self.shape, self.dtype = tuple(index.shape), fused.dtype

    def numel(self) -> int:
        return self.index.numel()

    def value(self) -> torch.Tensor:
        """A copy of the tensor's current values, in its checkpoint shape."""
        flat = self.fused.data.view(-1)
        return flat.index_select(0, self.index.reshape(-1).to(flat.device)).reshape(self.shape)

    def copy_(self, t: torch.Tensor, non_blocking: bool = False) -> None:
        flat = self.fused.data.view(-1)
        flat.index_copy_(
            0, self.index.reshape(-1).to(flat.device), t.reshape(-1).to(device=flat.device, dtype=flat.dtype)
        )


def checkpoint_views(model) -> dict[str, torch.nn.Parameter | SplitParam]:
    """Checkpoint name -> the parameter (or the part of a fused parameter) it loads into."""
    params = dict(model.named_parameters())
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers keeps checkpoint layouts in memory
        return params
    state = model.state_dict()
    shapes = {k: torch.empty(v.shape, dtype=torch.float64, device="meta") for k, v in state.items()}
    names = set(revert_weight_conversion(model, shapes))
    fused = [n for n in params if n not in names]
    if not fused:
        return params
    probe, bases, base = dict(shapes), [], 0
    for n in fused:
        numel = params[n].numel()
        probe[n] = torch.arange(base, base + numel, dtype=torch.float64).reshape(params[n].shape)
        bases.append((base, base + numel, n))
        base += numel
    if base >= 2**53:
        raise ValueError(f"{base} fused elements: too many to map exactly through float64 indices")
    out = {n: p for n, p in params.items() if n not in fused}
    for name, t in revert_weight_conversion(model, probe).items():
        if name in out or t.device.type == "meta":
            continue
        idx = t.to(torch.int64)
        lo = int(idx.min())
        start, end, owner = next(b for b in bases if b[0] <= lo < b[1])
        if int(idx.max()) >= end:
            raise ValueError(f"tensor {name}: spans several fused parameters; cannot load it in place")
        out[name] = SplitParam(params[owner], idx - start)
    covered = sum(v.numel() for k, v in out.items() if isinstance(v, SplitParam))
    if covered != sum(params[n].numel() for n in fused):
        raise ValueError(
            f"checkpoint names cover {covered} of the {base} fused elements of "
            f"{type(model).__name__}; its weight conversion is not a plain split"
        )
    return out
