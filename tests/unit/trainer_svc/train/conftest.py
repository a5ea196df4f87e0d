import pytest


@pytest.fixture
def hf_actor_factory():
    from trainer_svc.actor.hf.actor import HfActor
    from trainer_svc.config import OptimConfig
    from trainer_svc.train.step import train_state
    from weightsync.models import resolve_model

    def make(seed=1, **settings):
        cfg, _ = resolve_model("tiny-qwen2")
        a = HfActor(cfg, seed=seed)
        train_state(a, OptimConfig(**{"lr": 1e-3, **settings}))
        return a

    return make
