"""rollout-svc command line: `rollout-svc serve [flags]`."""

from __future__ import annotations

import sys

from rollout_svc.config import ENV_PREFIX, RolloutConfig
from weightsync.service_cli import Service


def _make_app(cfg: RolloutConfig):
    from rollout_svc.app import RolloutApp

    return RolloutApp(cfg)


SERVICE = Service(
    "rollout-svc", "weightsync rollout service", "run the rollout service", RolloutConfig, ENV_PREFIX, _make_app
)
build_parser = SERVICE.build_parser
main = SERVICE.main

if __name__ == "__main__":
    sys.exit(main())
