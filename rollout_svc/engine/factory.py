"""Build the configured engine; heavy engine modules are imported only when chosen."""

from __future__ import annotations

from weightsync.bus.dtypes import parse_dtype
from weightsync.models import resolve_model


def make_engine(rollout_cfg):
    cfg = rollout_cfg.inference
    if cfg.engine == "sglang":
        from rollout_svc.engine.sglang_engine import SglangEngine  # needs the [sglang] extra and a GPU

        return SglangEngine.from_rollout_config(cfg)
    from rollout_svc.engine.builtin import BuiltinEngine

    config, weights_dir = resolve_model(cfg.model)
    dtype = parse_dtype(cfg.dtype)
    if weights_dir:
        return BuiltinEngine.from_pretrained(
            weights_dir, dtype=dtype, device=cfg.device, max_prefix_cache_entries=cfg.max_prefix_cache_entries
        )
    return BuiltinEngine.from_config(
        config,
        seed=cfg.init_seed,
        dtype=dtype,
        device=cfg.device,
        max_prefix_cache_entries=cfg.max_prefix_cache_entries,
    )
