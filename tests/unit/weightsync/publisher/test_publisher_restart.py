"""Issue 49: a Publisher restarted with the same trainer_id publishes again at once.

Before, the new publisher counted from version 1 and the rollout refused it as a rollback of the
trainer's version 3 ("going back is a rollback"); now it continues from the version the rollout
reports when it registers, and the rollback rule still holds for a lower version.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.weightsync.publisher.test_publisher import LOOPBACK, _register, _rollout
from weightsync.bus.errors import SyncError
from weightsync.control.client import channel, trainer_stub
from weightsync.publisher import Auth, Publisher, SyncOptions
from weightsync.sync_options import MIB
from weightsync.v1 import rollout_pb2

ONE_MIB = SyncOptions(bucket_bytes=MIB)


def _given(pub, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=g) for m in pub.source.export_metas()}


def _assert_serves(app, given: dict, version: int) -> None:
    assert app.tx.version == version and app.tx.state == rollout_pb2.SERVING
    for name, t in given.items():
        assert torch.equal(app.engine._target(name), t), name


def test_a_restarted_publisher_with_the_same_trainer_id_publishes_a_newer_version_at_once():
    from weightsync.models import resolve_model

    token = "s3cret"
    config, _ = resolve_model("tiny-qwen2")
    app = _rollout(token, "r1")
    try:
        with Publisher(config, auth=Auth(token=token), trainer_id="job-7", options=ONE_MIB, **LOOPBACK) as first:
            _register(first, trainer_stub(channel(first.address), token, 30), app, "r1")
            for version in (1, 2, 3):
                given = _given(first, version)
                assert first.sync(given.items()).version == version
            _assert_serves(app, given, 3)
        # the job resumes: a new publisher, the same trainer id, its count back at 0
        with Publisher(config, auth=Auth(token=token), trainer_id="job-7", options=ONE_MIB, **LOOPBACK) as again:
            assert again.version == 0
            _register(again, trainer_stub(channel(again.address), token, 30), app, "r1")
            given = _given(again, 40)
            report = again.sync(given.items())
            assert report.ok and report.version == 4 and again.version == 4
            _assert_serves(app, given, 4)
            given = _given(again, 41)
            assert again.sync(given.items()).version == 5
            _assert_serves(app, given, 5)
        # nobody else got a window: a lower version of that trainer id is still a rollback
        assert not app.pin.check_rollback("job-7", 6, 5, False)
        with pytest.raises(SyncError, match="going back is a rollback"):
            app.pin.check_rollback("job-7", 2, 5, False)
    finally:
        app.stop()
