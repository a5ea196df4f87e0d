"""A payload byte corrupted in flight is reported as DATA_LOSS end to end (issue 37).

A real TrainerApp and RolloutApp on loopback; the rollout's data port sits behind
tests.support.bus_proxy, which flips one byte of the bus stream. The rollout's checksum catches it
and closes the stream, so the trainer's send sees a broken pipe or reset; the report, wsctl and the
failure metric must still say DATA_LOSS with the rollout's checksum reason, and the next sync
(unshaped) commits exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.bus_proxy import BusProxy
from tests.support.fleet_sync import bump_and_sync_exactly
from tests.support.local_apps import local_fleet
from weightsync.local.procs import free_port
from weightsync.v1 import trainer_pb2
from weightsync.wsctl.cli import main

TOKEN = "dataloss-s3cret"
#: well inside the first bucket's tensor bytes (its frame header is a few dozen bytes)
FLIP_AT = 200_000


@pytest.fixture(scope="module")
def fleet():
    dport = free_port()
    proxy = BusProxy("127.0.0.2", dport, ("127.0.0.1", dport))
    rollout = {"r": {"data_address": f"127.0.0.1:{dport}", "advertise_data_host": "127.0.0.2"}}
    try:
        with local_fleet(rollout, TOKEN) as (trainer, rollouts, stub):
            yield trainer, rollouts["r"], stub, proxy
    finally:
        proxy.close()


def _data_loss_count(trainer) -> float:
    return trainer.metrics.failures.labels("trainer", "data_loss")._value.get()


def test_a_byte_flipped_in_flight_is_reported_as_data_loss(fleet, capsys, monkeypatch):
    trainer, app, stub, proxy = fleet
    monkeypatch.setattr(trainer.orch.delta, "encoding", "full")  # dense buckets: the flip lands 200 kB in
    bump_and_sync_exactly(trainer, {"r": app}, stub)  # a clean sync first: the link is open
    assert proxy.protocols["bus"] >= 1  # the bus really goes through the proxy
    before = _data_loss_count(trainer)

    trainer.actor.version += 1
    proxy.set("flip", after_bytes=FLIP_AT)
    rep = stub.Sync(trainer_pb2.SyncRequest()).report
    assert proxy.links.flip_at is None, "the proxy flipped no byte"
    assert not rep.ok
    err = rep.rollouts[0].error
    assert err.startswith("DATA_LOSS: ") and "checksum" in err and "corrupted in transit" in err, err
    assert _data_loss_count(trainer) == before + 1
    assert app.tx.version == trainer.actor.version - 1  # the rollout kept its weights

    # wsctl shows it
    trainer.actor.version += 1
    proxy.set("flip", after_bytes=FLIP_AT)
    monkeypatch.setenv("WSCTL_TOKEN", TOKEN)
    capsys.readouterr()
    assert main(["--address", trainer.grpc.address, "sync"]) != 0
    assert "FAILED: DATA_LOSS: " in capsys.readouterr().out
    assert _data_loss_count(trainer) == before + 2

    proxy.set("pass")
    bump_and_sync_exactly(trainer, {"r": app}, stub)


#: offsets in the stream after the hello: a delta frame's header is 25 bytes, then its payload's 16-byte
#: header (kind at 25, word at 26, entries at 33..40), its positions and words; 3000 is well past them
@pytest.mark.parametrize("flip_at", [3000, 26, 34, 45], ids=["words", "word-size", "entries", "positions"])
def test_a_byte_flipped_in_a_delta_fails_the_sync_and_the_next_one_is_full_and_exact(fleet, flip_at):
    trainer, app, stub, proxy = fleet
    bump_and_sync_exactly(trainer, {"r": app}, stub)  # both ends hold the base
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # 2 % of the values change: the next sync is a delta of a few kB
        for p in trainer.actor.model.parameters():
            mask = torch.rand(p.shape, generator=g) < 0.02
            p[mask] = p[mask] * 1.5 + 0.01
    trainer.actor.version += 1
    proxy.set("flip", after_bytes=flip_at)
    rep = stub.Sync(trainer_pb2.SyncRequest()).report
    assert proxy.links.flip_at is None, "the proxy flipped no byte"
    r = rep.rollouts[0]
    assert not rep.ok and r.encoding == "delta" and r.wire_bytes < 0.15 * rep.bytes, (r.encoding, r.wire_bytes)
    # a damaged delta frame (its header, positions or words) is corruption in flight, as the docs promise
    assert r.error.startswith("DATA_LOSS: "), r.error
    assert app.tx.version == trainer.actor.version - 1  # the rollout kept its weights
    proxy.set("pass")
    rep = bump_and_sync_exactly(trainer, {"r": app}, stub)  # checks the rollout's weights bit for bit
    assert rep.rollouts[0].encoding == "full"
