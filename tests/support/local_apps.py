"""In-process trainer and rollout apps on loopback for tests, with the settings most tests share;
each test names only what it changes (any TrainerConfig / RolloutConfig field)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

_TRAINER = {
    "grpc_address": "127.0.0.1:0",
    "http_address": "127.0.0.1:0",
    "backend": "hf",
    "model": "tiny-qwen2",
    "bucket_mb": 1,
    "sync_timeout_s": 30.0,
    "auto_sync_new_rollouts": False,
}
_ROLLOUT = {"grpc_address": "127.0.0.1:0", "http_address": "127.0.0.1:0", "model": "tiny-qwen2"}


def trainer_app(*, validate: bool = False, **fields):
    """A TrainerApp built but not started, for tests that change it before start or expect its
    construction to fail; `validate` runs the config's checks first, as the services' CLIs do."""
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig

    cfg = TrainerConfig.from_flat(**{**_TRAINER, **fields})
    if validate:
        cfg.validate()
    return TrainerApp(cfg)


def rollout_app(rollout_id: str, *, validate: bool = False, **fields):
    """A RolloutApp built but not started (see trainer_app)."""
    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig

    cfg = RolloutConfig.from_flat(**{**_ROLLOUT, "rollout_id": rollout_id, **fields})
    if validate:
        cfg.validate()
    return RolloutApp(cfg)


def start_trainer(*, validate: bool = False, **fields):
    """A started TrainerApp (stop it)."""
    app = trainer_app(validate=validate, **fields)
    app.start()
    return app


def start_rollout(rollout_id: str, *, validate: bool = False, **fields):
    """A started RolloutApp (stop it)."""
    app = rollout_app(rollout_id, validate=validate, **fields)
    app.start()
    return app


class Fleet(NamedTuple):
    trainer: object  # TrainerApp
    rollouts: dict  # rollout id -> RolloutApp
    stub: object  # the trainer's stub, sending the fleet's token


@contextmanager
def local_fleet(rollouts: dict[str, dict], token: str = "", stub_timeout_s: float = 60, **trainer_fields):
    """A started trainer (`trainer_fields` over the shared settings) and one started rollout per entry of
    `rollouts` (id -> its RolloutConfig fields), each registered with the trainer; every app takes `token`
    as its auth_token. Everything started is stopped on exit, the rollouts before the trainer, also when a
    start or a registration fails halfway. Test doubles that replace a bus or a GPU boundary are set by the
    caller on the yielded apps: nothing syncs before the test asks (auto_sync_new_rollouts is off)."""
    from weightsync.control.client import channel, trainer_stub
    from weightsync.v1 import trainer_pb2

    trainer = start_trainer(auth_token=token, **trainer_fields)
    apps: dict = {}
    try:
        for rid, fields in rollouts.items():
            apps[rid] = start_rollout(rid, auth_token=token, **fields)
        stub = trainer_stub(channel(trainer.grpc.address), token, stub_timeout_s)
        for rid, app in apps.items():
            stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id=rid, address=app.grpc.address))
        yield Fleet(trainer, apps, stub)
    finally:
        for app in apps.values():
            app.stop()
        trainer.stop()
