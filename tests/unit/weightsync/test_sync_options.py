"""SyncOptions: validated when built, each error naming the field and what it must be; trainer-svc's
bus section maps onto it in bytes and seconds, with the same defaults."""

from __future__ import annotations

import math

import pytest

from trainer_svc.config import BusConfig, TrainerConfig
from weightsync.sync_options import DEFAULTS, IPC_DIRECTIONS, MIB, MIN_BUCKET_BYTES, SyncOptions


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"transport": "pigeon"}, "SyncOptions.transport='pigeon' must be tcp, nccl or ipc"),
        ({"bucket_bytes": 0}, r"SyncOptions.bucket_bytes=0 must be in \[256, 17179869184\] bytes"),
        ({"bucket_bytes": 16385 * MIB}, "SyncOptions.bucket_bytes=17180917760 must be in"),
        ({"sync_timeout_s": 0}, "SyncOptions.sync_timeout_s=0 must be a finite number of seconds > 0"),
        ({"rpc_timeout_s": -1.0}, "SyncOptions.rpc_timeout_s=-1.0 must be"),
        ({"nccl_init_timeout_s": math.inf}, "SyncOptions.nccl_init_timeout_s=inf must be"),
        ({"liveness_timeout_s": math.nan}, "SyncOptions.liveness_timeout_s=nan must be"),
        ({"senders": "everyone"}, "SyncOptions.senders='everyone' must be all or rank0"),
        ({"sync_encoding": "sometimes"}, "SyncOptions.sync_encoding='sometimes' must be full, delta or auto"),
        (
            {"sync_encoding": "delta", "transport": "ipc"},
            "SyncOptions.sync_encoding='delta' is carried by transports tcp or nccl only .transport=ipc.",
        ),
        ({"delta_base_bytes": -1}, "SyncOptions.delta_base_bytes=-1 must be >= 0"),
        ({"delta_link_gbps": math.nan}, "SyncOptions.delta_link_gbps=nan must be >= 0"),
        ({"ipc_direction": "sideways"}, "SyncOptions.ipc_direction='sideways' must be auto, rollout_reads or"),
        ({"device": "tpu"}, "SyncOptions.device='tpu' must be cpu, cuda or cuda:N"),
    ],
)
def test_a_bad_field_is_refused_naming_it(changes, why):
    with pytest.raises(ValueError, match=why):
        SyncOptions(**changes)
    with pytest.raises(ValueError, match=why):
        DEFAULTS.but(**changes)  # a copy is validated as a new object is


def test_it_is_frozen_and_the_defaults_are_valid():
    with pytest.raises(AttributeError):
        DEFAULTS.bucket_bytes = 1  # type: ignore[misc]
    assert DEFAULTS.bucket_mb == 1024 and DEFAULTS.delta_base_bytes == 32 << 30


def test_the_ipc_directions_and_the_smallest_bucket_are_the_bus_ones():
    from weightsync.bus.ipc.trainer_writes import DIRECTIONS
    from weightsync.bus.plan import ALIGN

    assert IPC_DIRECTIONS == DIRECTIONS
    assert MIN_BUCKET_BYTES == ALIGN


def test_the_bus_section_maps_onto_it_in_bytes_with_the_same_defaults():
    assert BusConfig().sync_options() == DEFAULTS  # no default restated in another unit
    cfg = TrainerConfig.from_flat(
        bucket_mb=64, delta_base_mb=100, transport="nccl", liveness_timeout_s=5.0, senders="rank0"
    )
    got = cfg.bus.sync_options("fp8-block", "cuda:1")
    assert got == DEFAULTS.but(
        bucket_bytes=64 << 20,
        delta_base_bytes=100 << 20,
        transport="nccl",
        liveness_timeout_s=5.0,
        senders="rank0",
        export_dtype="fp8-block",
        device="cuda:1",
    )
