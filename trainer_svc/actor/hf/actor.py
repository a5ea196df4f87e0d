"""A single-process transformers backend for the trainer (`--backend hf`).

Useful where megatron-core is not installed and for debugging the bus: it exports the model's
own HF state dict (in checkpoint naming: a tied lm_head is not exported twice), from the device
the model lives on (`--device`), so the GPU transports send straight from GPU memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from trainer_svc.actor.base import Actor
from trainer_svc.actor.hf.train_backend import HfBackend
from weightsync.bus.plan import TensorMeta
from weightsync.model_spec import family_of


class HfActor(Actor):
    def __init__(
        self,
        config,
        *,
        seed: int = 0,
        export_dtype: torch.dtype = torch.float32,
        weights_dir: str | None = None,
        device: torch.device | str = "cpu",
        param_dtype: torch.dtype = torch.float32,
    ):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.config = config
        # Initialised on the CPU in fp32, then moved and cast: the weights for a seed are the same
        # on every device (and, to the cast's rounding, in every dtype).
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.device = torch.device(device)
        self.model.to(device=self.device, dtype=param_dtype)
        self.model.eval()
        self.family = family_of(config)
        self.export_dtype = export_dtype
        # Names, shapes and the export dtype never change after construction (load_hf copies in
        # place): computed once, so planning a sync does not walk the module tree.
        self._metas = [TensorMeta(n, tuple(p.shape), self.export_dtype) for n, p in self._named()]
        self._flat: tuple[str, list[torch.Tensor]] | None = None  # (layout digest, bucket storage): flat_buckets
        self.version = 1
        if weights_dir:
            self.load_hf(weights_dir)
            self.version = 1
        #: completed optimizer steps, and the training state (optimizer, reference) once training starts
        self.step = 0
        self.train_state = None

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        return [(n, p) for n, p in self.model.state_dict().items() if not (tied and n == "lm_head.weight")]

    def export_metas(self) -> list[TensorMeta]:
        return self._metas

    def flat_buckets(self, manifest, quantize: bool = True) -> list[torch.Tensor] | None:
        """The manifest's buckets as this model's own memory, so a sync sends it with no pack copy.

        The first call for a layout moves every exported parameter into flat buffers laid out as
        the manifest's buckets (bucket by bucket: the extra memory is one bucket at a time), and
        points the parameter there; training, loads and exports go on using the same parameters.
        None when the parameters are not the export as they are (another dtype) or the layout has
        no digest to recognise it by.
        """
        digest = manifest.layout_digest
        if not digest:
            return None
        if self._flat is not None and self._flat[0] == digest:
            return self._flat[1]
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for b in manifest.buckets:
            for slot in b.slots:
                p = params.get(slot.meta.name)
                if p is None or p.dtype != slot.meta.dtype or tuple(p.shape) != slot.meta.shape:
                    return None
        flats = []
        with torch.no_grad():
            for b in manifest.buckets:
                flat = torch.zeros(b.nbytes, dtype=torch.uint8, device=self.device)  # padding included: checksummed
                for slot in b.slots:
                    p = params[slot.meta.name]
                    view = flat[slot.offset : slot.offset + slot.meta.nbytes].view(p.dtype).view(p.shape)
                    view.copy_(p)
                    p.data = view
                flats.append(flat)
        self._flat = (digest, flats)
        return flats

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, p in self._named():
            yield n, p.detach().to(self.export_dtype)

    def load_hf(self, path: str) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"hf_path {path}: no *.safetensors files")
        state = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except SafetensorError as exc:  # truncated or not safetensors at all: the caller's file, not our bug
                raise ValueError(f"hf_path {path}: {f.name} is not a readable safetensors file ({exc})") from None
        own = dict(self._named())
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"hf_path {path}: missing tensor {missing[0]} ({len(missing)} missing in all)")
        with torch.no_grad():
            for n, p in own.items():
                if tuple(state[n].shape) != tuple(p.shape):
                    raise ValueError(
                        f"hf_path {path}: tensor {n} has shape {tuple(state[n].shape)}, model expects {tuple(p.shape)}"
                    )
            for n, p in own.items():
                p.copy_(state[n])
        self.version += 1

    def num_parameters(self) -> int:
        return sum(p.numel() for _, p in self._named())

    def describe_parallelism(self) -> str:
        return "single process (transformers)"

    def hf_config(self):
        return self.config

    def train_backend(self) -> HfBackend:
        return HfBackend(self)

    def shutdown(self) -> None:
        pass
