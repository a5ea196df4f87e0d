"""Every sync's route shows in `wsctl sync --json` and `wsctl sync`, and labels the trainer's sync
duration and phase metrics: a real CPU sync, trainer-svc (hf actor) to a rollout over tcp."""

from __future__ import annotations

import json

import pytest

from tests.support.local_apps import local_fleet
from weightsync.wsctl.cli import EXIT_OK, main

TOKEN = "route-s3cret"


@pytest.fixture(scope="module")
def fleet():
    with local_fleet({"r": {}}, TOKEN, sync_encoding="full") as f:
        yield f


def test_the_route_is_in_the_json_report_the_plain_output_and_the_metrics(fleet, monkeypatch, capsys):
    trainer = fleet.trainer
    monkeypatch.setenv("WSCTL_TOKEN", TOKEN)
    assert main(["--address", trainer.grpc.address, "sync", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    # tiny-qwen2 exported in float32 (trainer-svc's export_dtype default), rank 0 alone, dense buckets
    assert report["ok"] is True and report["route"] == "tcp/single/fp32/full"
    assert trainer.orch.last_report.route == "tcp/single/fp32/full"
    # the built-in engine (one rank) reports the sync's bytes as its own; SGLang one entry per TP rank
    (rollout,) = report["rollouts"]
    assert rollout["bytes_per_rank"] == [report["bytes"]], rollout

    trainer.actor.version += 1
    assert main(["--address", trainer.grpc.address, "sync"]) == EXIT_OK
    assert "  route: tcp/single/fp32/full\n" in capsys.readouterr().out

    reg = trainer.metrics.registry
    labels = {"role": "trainer", "route": "tcp/single/fp32/full"}
    assert reg.get_sample_value("weightsync_sync_duration_seconds_count", labels) == 2
    assert reg.get_sample_value("weightsync_sync_phase_seconds_count", {**labels, "phase": "stream"}) == 2
