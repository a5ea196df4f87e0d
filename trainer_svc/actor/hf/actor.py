"""A single-process transformers backend for the trainer (`--backend hf`).

Useful where megatron-core is not installed and for debugging the bus: it exports the model's
own HF state dict (in checkpoint naming: a tied lm_head is not exported twice), from the device
the model lives on (`--device`), so the GPU transports send straight from GPU memory.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from trainer_svc.actor.hf.train_backend import HfBackend
from weightsync.bus.plan import TensorMeta
from weightsync.model_spec import family_of


class HfActor:
    def __init__(self, config, *, seed: int = 0, export_dtype: torch.dtype = torch.float32, weights_dir: str | None = None,
                 device: torch.device | str = "cpu"):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.config = config
        # Initialised on the CPU, then moved: the weights for a seed are the same on every device.
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.device = torch.device(device)
        self.model.to(self.device)
        self.model.eval()
        self.family = family_of(config)
        self.export_dtype = export_dtype
        # Names, shapes and the export dtype never change after construction (load_hf copies in
        # place): computed once, so planning a sync does not walk the module tree (~1 ms for 339 tensors).
        self._metas = [TensorMeta(n, tuple(p.shape), self.export_dtype) for n, p in self._named()]
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

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, p in self._named():
            yield n, p.detach().to(self.export_dtype)

    def load_hf(self, path: str) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"hf_path {path}: no *.safetensors files")
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        own = dict(self._named())
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"hf_path {path}: missing tensor {missing[0]} ({len(missing)} missing in all)")
        with torch.no_grad():
            for n, p in own.items():
                if tuple(state[n].shape) != tuple(p.shape):
                    raise ValueError(f"hf_path {path}: tensor {n} has shape {tuple(state[n].shape)}, model expects {tuple(p.shape)}")
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
