"""rollout-svc command line: `rollout-svc serve [flags]`."""
from __future__ import annotations

import argparse
import sys

from rollout_svc.config import ENV_PREFIX, RolloutConfig
from weightsync.config import ConfigError, add_arguments, resolve
from weightsync.obs.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-svc", description="weightsync rollout service")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the rollout service")
    add_arguments(serve, RolloutConfig, ENV_PREFIX)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        cfg = resolve(RolloutConfig, ns, ENV_PREFIX)
    except ConfigError as exc:
        print(f"rollout-svc: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging("rollout-svc", cfg.log_level, cfg.log_format)
    from rollout_svc.app import RolloutApp

    try:
        app = RolloutApp(cfg)
    except (RuntimeError, ValueError, ConfigError) as exc:
        print(f"rollout-svc: cannot start: {exc}", file=sys.stderr)
        return 1
    app.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
