"""trainer-svc command line: `serve` (the service) and `convert` (offline HF <-> Megatron)."""
from __future__ import annotations

import argparse
import sys

from trainer_svc.config import ENV_PREFIX, TrainerConfig
from weightsync.config import ConfigError, add_arguments, resolve
from weightsync.obs.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer-svc", description="weightsync trainer service (the actor)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the trainer service (under torchrun for TP/PP > 1)")
    add_arguments(serve, TrainerConfig, ENV_PREFIX)
    sub.add_parser("convert", help="convert checkpoints between HF and Megatron layouts (see `convert --help`)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "convert":
        from trainer_svc.megatron.convert import main as convert_main

        return convert_main(argv[1:])
    ns = build_parser().parse_args(argv)
    try:
        cfg = resolve(TrainerConfig, ns, ENV_PREFIX)
    except ConfigError as exc:
        print(f"trainer-svc: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging("trainer-svc", cfg.log_level, cfg.log_format)
    from trainer_svc.app import TrainerApp, global_rank

    if global_rank() != 0:
        from trainer_svc.actor.factory import make_actor

        actor = make_actor(cfg)
        actor.worker_loop()
        return 0
    try:
        app = TrainerApp(cfg)
    except (RuntimeError, ValueError, ConfigError) as exc:
        print(f"trainer-svc: cannot start: {exc}", file=sys.stderr)
        return 1
    app.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
