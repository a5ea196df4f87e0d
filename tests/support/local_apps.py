"""In-process trainer and rollout apps on loopback for tests, with the settings most tests share;
each test names only what it changes (any TrainerConfig / RolloutConfig field)."""

from __future__ import annotations

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


def start_trainer(**fields):
    """A started TrainerApp (stop it)."""
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig

    app = TrainerApp(TrainerConfig.from_flat(**{**_TRAINER, **fields}))
    app.start()
    return app


def start_rollout(rollout_id: str, **fields):
    """A started RolloutApp (stop it)."""
    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig

    app = RolloutApp(RolloutConfig.from_flat(**{**_ROLLOUT, "rollout_id": rollout_id, **fields}))
    app.start()
    return app
