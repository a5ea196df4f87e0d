import pytest

from tests.unit.weightsync.http.rest_helpers import TOKEN


@pytest.fixture(scope="module")
def services():
    """A trainer (hf backend) and a registered rollout, in process, with a token on both."""
    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig

    trainer = TrainerApp(
        TrainerConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            backend="hf",
            model="tiny-qwen2",
            auth_token=TOKEN,
            rpc_timeout_s=5.0,
            sync_timeout_s=30.0,
            auto_sync_new_rollouts=False,
        )
    )
    trainer.start()
    rollout = RolloutApp(
        RolloutConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            model="tiny-qwen2",
            rollout_id="r1",
            auth_token=TOKEN,
            sync_timeout_s=30.0,
            serve_initial_weights=True,
        )
    )
    rollout.start()
    from weightsync.control.client import channel, trainer_stub
    from weightsync.v1 import trainer_pb2

    with channel(trainer.grpc.address) as ch:
        trainer_stub(ch, TOKEN, 30).RegisterRollout(
            trainer_pb2.RegisterRolloutRequest(rollout_id="r1", address=rollout.grpc.address)
        )
    yield trainer, rollout
    rollout.stop()
    trainer.stop()
