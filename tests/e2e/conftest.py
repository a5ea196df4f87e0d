import os

import pytest

from weightsync.local.procs import start_rollout, start_trainer

# The trainer backend the e2e suite drives; megatron is the product default.
BACKEND = os.environ.get("WS_E2E_BACKEND", "megatron")


@pytest.fixture
def procs(tmp_path):
    """Start processes through this fixture so they are always stopped, with logs on failure."""
    started = []

    def trainer(*args, **kw):
        p = start_trainer(tmp_path, "--backend", kw.pop("backend", BACKEND), *args, **kw)
        started.append(p)
        return p

    def rollout(*args, **kw):
        p = start_rollout(tmp_path, *args, **kw)
        started.append(p)
        return p

    class P:
        pass

    P.trainer, P.rollout, P.tmp = staticmethod(trainer), staticmethod(rollout), tmp_path
    yield P
    # signal every process first, then wait: their shutdowns overlap instead of adding up
    for p in started:
        if p.popen.poll() is None:
            p.popen.terminate()
    for p in started:
        p.stop()
