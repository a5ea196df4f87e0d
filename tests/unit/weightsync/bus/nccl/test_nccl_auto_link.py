"""sync_encoding=auto over nccl decides by the link's measured rate (trainer config delta_link_gbps).

A TrainerApp (hf, auto) and two RolloutApps on loopback gRPC, the NCCL library replaced by the gloo
stand-in (tests/support/gloo_nccl.py: real broadcasts, in one process). The link's speed is made slow
or fast deterministically by the knob, never by racing real speeds: 10^9 Gb/s makes any measured rate
slow, 1e-9 any fast. Slow: the first sync (its group is built in it) measures nothing, the second
measures the link, the third keeps its base, the fourth offers it (the rollouts hold none yet: dense,
framed, kept by them) and the fifth goes as deltas, exact. Fast: every sync full, no base kept, and
the rate is on the trainer's metrics (weightsync/publisher/delta_sync.py).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from tests.support.fleet_sync import change_weights
from tests.support.gloo_nccl import GlooNcclBus
from tests.support.local_apps import local_fleet
from weightsync.bus.nccl.sender import NcclSender
from weightsync.v1 import rollout_pb2, trainer_pb2


@contextlib.contextmanager
def _fleet(link_gbps: float):
    bus = GlooNcclBus()
    rollouts = {"staged": {"apply_mode": "staged"}, "inplace": {"apply_mode": "inplace"}}
    with local_fleet(rollouts, sync_encoding="auto", delta_link_gbps=link_gbps) as fleet:
        fleet.trainer.orch.transports["nccl"] = NcclSender(torch.device("cpu"), bus, 10.0)
        fleet.trainer.orch.bucket_bytes = 64 << 10  # several buckets (tiny-qwen2 is 0.4 MB)
        for app in fleet.rollouts.values():
            app.servicer.nccl._bus = bus
        yield fleet


def _sync(trainer, stub, seed: int):
    change_weights(trainer, 0.02, seed=seed)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="nccl")).report
    assert report.ok, [r.error for r in report.rollouts]
    return report


def _exact(trainer, app) -> bool:
    return (
        app.tx.version == trainer.actor.version
        and app.tx.state == rollout_pb2.SERVING
        and all(torch.equal(app.engine._target(name), t) for name, t in trainer.actor.export_tensors())
    )


def _gauge(trainer) -> float:
    return trainer.host.metrics.registry.get_sample_value("weightsync_nccl_link_bytes_per_second", {"role": "trainer"})


def test_a_slow_link_turns_auto_on_nccl_to_deltas():
    with _fleet(1e9) as (trainer, rollouts, stub):
        delta = trainer.orch.delta
        encodings = []
        for i in range(5):
            report = _sync(trainer, stub, seed=40 + i)
            encodings.append({r.encoding for r in report.rollouts})
            for app in rollouts.values():
                assert _exact(trainer, app), (i, app.tx.version)
            if i == 0:  # its group was built in it: no measure
                assert delta.link_rate is None and delta.held is None and _gauge(trainer) == 0
            if i == 1:  # measured, decided for the next sync: nothing kept yet
                assert delta.link_rate > 0 and delta.held is None and _gauge(trainer) == delta.link_rate
            if i == 2:  # kept, not yet offered
                assert delta.held is not None and delta.held[0] == trainer.actor.version
        assert encodings == [{"full"}] * 4 + [{"delta"}], encodings
        assert report.wire_bytes < 0.15 * report.bytes * len(rollouts), (report.wire_bytes, report.bytes)


def test_a_fast_link_keeps_auto_on_nccl_full_with_no_base():
    with _fleet(1e-9) as (trainer, rollouts, stub):
        delta = trainer.orch.delta
        for i in range(4):
            report = _sync(trainer, stub, seed=60 + i)
            assert {r.encoding for r in report.rollouts} == {"full"}, i
            assert report.wire_bytes == report.bytes * len(rollouts), (report.wire_bytes, report.bytes)
            assert delta.held is None and delta.held_bytes() == 0, i
            for app in rollouts.values():
                assert _exact(trainer, app), (i, app.tx.version)
        assert delta.link_rate > 0 and _gauge(trainer) == pytest.approx(delta.link_rate)


#: the knob of the two tests below, in bytes/s: between the paced links' rates and a slow receiver's aggregate
KNOB_BPS = 1.6e6


def _streamed_calls(monkeypatch) -> list:
    """What each full stream handed the link rule: (bytes, seconds waited in the sends, fastest bucket's rate)."""
    from weightsync.publisher import delta_sync

    calls, real = [], delta_sync.DeltaStream.streamed

    def streamed(self, nbytes, seconds, fresh, link_rate=0.0):
        calls.append((nbytes, seconds, link_rate))
        return real(self, nbytes, seconds, fresh, link_rate)

    monkeypatch.setattr(delta_sync.DeltaStream, "streamed", streamed)
    return calls


def test_a_receiver_slow_to_take_each_bucket_is_not_read_as_a_slow_link(monkeypatch):
    """The link paced at 8 MB/s, one rollout 150 ms late to take each bucket after the first (its hand-over
    of the previous one, as SGLang's at tp_size 2): the stream's aggregate rate is far below the knob, its
    fastest bucket's, the link's, above it: auto stays full, no base kept."""
    monkeypatch.setenv("WS_GLOO_PACE_BPS", str(8e6))
    calls = _streamed_calls(monkeypatch)
    with _fleet(KNOB_BPS * 8e-9) as (trainer, rollouts, stub):
        slow = rollouts["inplace"].tx
        consume = slow.consume_bucket

        def late(*args, **kwargs):
            time.sleep(0.15)  # the receiver, not the link: it takes the next bucket this much later
            return consume(*args, **kwargs)

        slow.consume_bucket = late
        delta = trainer.orch.delta
        for i in range(3):
            report = _sync(trainer, stub, seed=80 + i)
            assert {r.encoding for r in report.rollouts} == {"full"}, i
            for app in rollouts.values():
                assert _exact(trainer, app), (i, app.tx.version)
        assert delta.held is None and delta.held_bytes() == 0
        nbytes, seconds, fastest = calls[-1]
        assert nbytes / seconds < KNOB_BPS / 2, "the receiver did not slow the stream: the test shows nothing"
        assert KNOB_BPS < fastest <= 8e6 * 1.01 and delta.link_rate == fastest


def test_a_paced_slow_link_still_reads_slow(monkeypatch):
    """No bucket crosses a 1 MB/s link faster than 1 MB/s: the fastest bucket's rate is below the knob."""
    monkeypatch.setenv("WS_GLOO_PACE_BPS", str(1e6))
    calls = _streamed_calls(monkeypatch)
    with _fleet(KNOB_BPS * 8e-9) as (trainer, rollouts, stub):
        for i in range(2):
            _sync(trainer, stub, seed=90 + i)
        delta = trainer.orch.delta
        assert 0 < delta.link_rate <= 1e6 * 1.01 and delta.link_rate == calls[-1][2]
        assert delta._fast_link() == "", "a 1 MB/s link read as fast"
