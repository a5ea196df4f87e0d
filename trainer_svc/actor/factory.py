"""Build the configured actor; megatron-core is imported only for backend=megatron."""

from __future__ import annotations

from weightsync.bus.dtypes import parse_dtype
from weightsync.models import resolve_model
from weightsync.publisher.export_format import actor_dtype


def make_actor(trainer_cfg):
    cfg, par = trainer_cfg.actor, trainer_cfg.parallel
    config, weights_dir = resolve_model(cfg.model)
    dtype = actor_dtype(cfg.export_dtype)
    if cfg.backend == "hf":
        from trainer_svc.actor.device import resolve_device
        from trainer_svc.actor.hf.actor import HfActor

        return HfActor(
            config,
            seed=cfg.init_seed,
            export_dtype=dtype,
            weights_dir=weights_dir,
            device=resolve_device(cfg.device),
            param_dtype=parse_dtype(cfg.param_dtype),
        )
    from trainer_svc.actor.megatron.actor import MegatronActor

    megatron_ckpt = trainer_cfg.checkpoint.load_megatron_checkpoint or None
    # a Megatron checkpoint replaces --model's weights (the model still gives the architecture)
    return MegatronActor.create(
        config,
        tp=par.tp,
        pp=par.pp,
        vpp=par.vpp,
        ep=par.ep,
        seed=cfg.init_seed,
        export_dtype=dtype,
        weights_dir=None if megatron_ckpt else weights_dir,
        converter=cfg.converter,
        mtp=cfg.mtp,
        megatron_checkpoint=megatron_ckpt,
        params_dtype=parse_dtype(cfg.param_dtype),
    )
