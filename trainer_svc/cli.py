"""trainer-svc command line: `serve` (the service) and `convert` (offline HF <-> Megatron)."""

from __future__ import annotations

import sys

from trainer_svc.config import ENV_PREFIX, TrainerConfig
from weightsync.service_cli import Service


def _convert(argv: list[str]) -> int:
    from trainer_svc.actor.megatron.convert import main as convert_main

    return convert_main(argv)


def _make_app(cfg: TrainerConfig):
    from trainer_svc.app import TrainerApp, global_rank

    if global_rank() != 0:  # torchrun worker: run rank 0's collective commands, serve nothing
        from trainer_svc.actor.factory import make_actor
        from trainer_svc.warm_up import warm_up_sender

        actor = make_actor(cfg)
        warm_up_sender(actor, cfg)
        actor.worker_loop()
        return None
    return TrainerApp(cfg)


SERVICE = Service(
    "trainer-svc",
    "weightsync trainer service (the actor)",
    "run the trainer service (under torchrun for TP/PP > 1)",
    TrainerConfig,
    ENV_PREFIX,
    _make_app,
    {"convert": ("convert checkpoints between HF and Megatron layouts (see `convert --help`)", _convert)},
)
build_parser = SERVICE.build_parser
main = SERVICE.main

if __name__ == "__main__":
    sys.exit(main())
