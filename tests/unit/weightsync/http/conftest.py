import pytest

from tests.support.local_apps import local_fleet
from tests.unit.weightsync.http.rest_helpers import TOKEN


@pytest.fixture(scope="module")
def services():
    """A trainer (hf backend) and a registered rollout, in process, with a token on both."""
    rollout = {"r1": {"sync_timeout_s": 30.0, "serve_initial_weights": True}}
    with local_fleet(rollout, TOKEN, stub_timeout_s=30, rpc_timeout_s=5.0) as (trainer, rollouts, _):
        yield trainer, rollouts["r1"]
