"""Issue 49: the trainer's status asks its rollouts at once: three silent rollouts cost one status
timeout, not three (before: 3 x the timeout, 15 s for `wsctl status` at the default)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.unit.weightsync.publisher.test_publisher import LOOPBACK, SPEC
from weightsync.control.client import channel, trainer_stub
from weightsync.publisher import Publisher, SyncOptions
from weightsync.v1 import trainer_pb2


@pytest.mark.serial
def test_three_silent_rollouts_cost_one_status_timeout():
    timeout = 1.0  # the registry asks each rollout with min(rpc_timeout_s, 5 s)
    silent = []
    pub = Publisher(SPEC, options=SyncOptions(rpc_timeout_s=timeout), **LOOPBACK).start()
    try:
        for i in range(3):  # listening, never answering: connect succeeds, the call waits out its timeout
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(8)
            silent.append(s)
            pub.host.registry.upsert(f"silent-{i}", f"127.0.0.1:{s.getsockname()[1]}")
        stub = trainer_stub(channel(pub.address), "", 30)
        t0 = time.monotonic()
        st = stub.GetStatus(trainer_pb2.TrainerStatusRequest())
        took = time.monotonic() - t0
        assert sorted(r.rollout_id for r in st.rollouts) == ["silent-0", "silent-1", "silent-2"]
        assert not any(r.reachable for r in st.rollouts) and all(r.last_error for r in st.rollouts)
        assert timeout * 0.9 <= took < 2 * timeout, took
    finally:
        pub.close()
        for s in silent:
            s.close()
