"""Training hyper-parameters of trainer-svc, read from the service config with env fallbacks.

The fields below are meant to live in `trainer_svc.config.TrainerConfig` (same names, same
defaults). Until they do, `TrainSettings.resolve(cfg)` takes each from `cfg` when it has it, else
from the env variable `WS_TRAINER_<NAME>` (the name the config's env layer will use), else the
default — so one set of knobs works before and after the config grows them.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainSettings:
    lr: float = 1e-6                 # peak learning rate (AdamW)
    lr_warmup_steps: int = 0         # linear warmup from lr/warmup to lr, then constant
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0           # max global grad norm (0 = off)
    checkpoint_dir: str = ""         # where SaveCheckpoint with an empty dir writes, and --resume reads
    resume: bool = False             # at start, load the latest checkpoint under checkpoint_dir if any

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be >= 0 (0 = off)")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=true needs checkpoint_dir")

    def lr_at(self, step: int) -> float:
        """LR for the optimizer step that follows `step` completed steps: linear warmup, then constant."""
        if self.lr_warmup_steps and step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        return self.lr

    @classmethod
    def resolve(cls, cfg: Any = None, environ: Mapping[str, str] | None = None) -> "TrainSettings":
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            if cfg is not None and hasattr(cfg, f.name):
                values[f.name] = getattr(cfg, f.name)
                continue
            raw = environ.get(f"WS_TRAINER_{f.name.upper()}")
            if raw is None:
                continue
            tp = type(f.default)
            if tp is bool:
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                try:
                    values[f.name] = tp(raw)
                except ValueError:
                    raise ValueError(f"WS_TRAINER_{f.name.upper()}={raw!r} is not a valid {tp.__name__}") from None
        out = cls(**values)
        out.validate()
        return out
