"""`--log-format json`: one JSON object per line with time, level, service, message and the sync and
rollout the line is about — from a log scope that follows each thread (concurrent syncs keep theirs),
and through a real sync of in-process services on loopback."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from weightsync.config import ConfigError, resolve
from weightsync.obs import logs
from weightsync.obs.logs import setup_logging


@pytest.fixture
def lines():
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    buf = io.StringIO()
    setup_logging("trainer-svc", "INFO", "json")
    root.handlers[0].setStream(buf)
    saved_process = dict(logs._process)
    logs._process.clear()  # a RolloutApp started by an earlier test of this process left its rollout_id

    def read() -> list[dict]:
        return [json.loads(line) for line in buf.getvalue().splitlines()]

    yield read
    root.handlers[:] = saved
    root.setLevel(level)
    logs._process.clear()
    logs._process.update(saved_process)


def test_a_line_is_one_object_with_the_scope_of_its_thread(lines):
    log = logging.getLogger("weightsync.test")
    gate = threading.Barrier(2, timeout=30)

    def sync(sync_id: str) -> None:
        with logs.context():
            logs.bind(sync_id=sync_id)
            gate.wait()  # both scopes open at once
            log.info("streaming %s", sync_id)

    threads = [threading.Thread(target=sync, args=(s,)) for s in ("v1-a", "v2-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    log.warning("between syncs")
    logs.process_fields(rollout_id="r7")
    with logs.context(sync_id="v3-c"):
        log.info("given", extra={"sync_id": "v9-extra"})  # a record's own field wins
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    out = lines()
    assert {(o["message"], o["sync_id"]) for o in out[:2]} == {("streaming v1-a", "v1-a"), ("streaming v2-b", "v2-b")}
    between = out[2]
    assert set(between) == {"time", "level", "service", "logger", "message"}
    assert (
        between["level"] == "WARNING" and between["service"] == "trainer-svc" and between["logger"] == "weightsync.test"
    )
    assert between["time"].endswith("Z") and len(between["time"]) == len("2026-11-28T14:00:00.000Z")
    assert out[3]["sync_id"] == "v9-extra" and out[3]["rollout_id"] == "r7"
    assert out[4]["sync_id"] == "v3-c" and "RuntimeError: boom" in out[4]["exc"]


def test_the_flag_is_shared_by_both_services_and_checked():
    import argparse

    from rollout_svc.config import ENV_PREFIX, RolloutConfig
    from weightsync.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, RolloutConfig, ENV_PREFIX)
    cfg = resolve(RolloutConfig, parser.parse_args(["--log-format", "json", "--model", "tiny-qwen2"]), ENV_PREFIX)
    assert cfg.log.log_format == "json"
    assert RolloutConfig.from_flat(model="tiny-qwen2").log.log_format == "text"  # the default
    with pytest.raises((ConfigError, SystemExit)):
        resolve(RolloutConfig, parser.parse_args(["--log-format", "xml"]), ENV_PREFIX)
    with pytest.raises(ValueError, match="log_format='xml' must be one of"):
        setup_logging("x", "INFO", "xml")


def test_a_real_sync_logs_its_id_on_the_trainer_and_the_rollout(lines):
    from tests.support.local_apps import local_fleet
    from weightsync.v1 import trainer_pb2

    with local_fleet({"r1": {}}, "json-logs-token") as (_, _, stub):
        report = stub.Sync(trainer_pb2.SyncRequest()).report
    assert report.ok, report
    mine = [o for o in lines() if o.get("sync_id") == report.sync_id]
    trainer = [o for o in mine if o["logger"].startswith("weightsync.publisher")]
    assert any("committed in" in o["message"] for o in trainer), mine
    rollout = [o for o in mine if o["logger"].startswith("rollout_svc")]
    assert rollout and all(o["rollout_id"] == "r1" for o in rollout), mine
