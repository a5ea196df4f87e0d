"""A sync's route: every valid combination has one string that parses back to it, invalid ones are
refused naming the word at fault, and `pick` reads the route off what a session and a manifest declare."""

from __future__ import annotations

import itertools

import pytest
import torch

from weightsync.bus.plan import Quantization, TensorMeta, make_manifest
from weightsync.bus.session import Session
from weightsync.publisher.route import ENCODINGS, PAYLOADS, Route, all_routes, encoding_of, payload_of, pick

SHAPES = ("single", "multi-sender", "trainer_writes", "rollout_reads")


def _expected_valid(transport: str, shape: str, encoding: str) -> bool:
    """The rule, written out independently of route.py: ipc names who writes and carries no delta;
    tcp and nccl name their senders (both multi-sender); nccl broadcasts, so never mixed encodings."""
    if transport == "ipc":
        return shape in ("trainer_writes", "rollout_reads") and encoding == "full"
    if shape not in ("single", "multi-sender"):
        return False
    return not (transport == "nccl" and encoding == "mixed")


@pytest.mark.parametrize("transport", ["tcp", "nccl", "ipc"])
def test_every_combination_is_valid_exactly_when_a_sync_can_take_it_and_names_itself(transport):
    for shape, payload, encoding in itertools.product(SHAPES, PAYLOADS, ENCODINGS):
        text = f"{transport}/{shape}/{payload}/{encoding}"
        if _expected_valid(transport, shape, encoding):
            route = Route(transport, shape, payload, encoding)
            assert str(route) == text
            assert Route.parse(text) == route
            assert route.multi_sender == (shape == "multi-sender")
            assert route.trainer_writes == (shape == "trainer_writes")
        else:
            with pytest.raises(ValueError, match=f"^route {text}: "):
                Route(transport, shape, payload, encoding)


def test_the_closed_set_of_routes_is_every_valid_combination_once():
    routes = all_routes()
    assert len(routes) == len(set(routes)) == len({str(r) for r in routes})
    # tcp: 2 shapes x 3 encodings; nccl: 2 shapes x 2 encodings; ipc: 2 writers x full
    assert len(routes) == (6 + 4 + 2) * len(PAYLOADS)
    assert "ipc/trainer_writes/bf16/full" in {str(r) for r in routes}
    assert "nccl/multi-sender/fp8-block/delta" in {str(r) for r in routes}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("ipc/trainer_writes/bf16", "must be <transport>/<shape>/<payload>/<encoding>"),
        ("pigeon/single/bf16/full", "transport 'pigeon' must be tcp, nccl or ipc"),
        ("ipc/multi-sender/bf16/full", "shape 'multi-sender' must be rollout_reads or trainer_writes over ipc"),
        ("tcp/trainer_writes/bf16/full", "shape 'trainer_writes' must be single or multi-sender over tcp"),
        ("tcp/single/int4/full", "payload 'int4' must be bf16, fp16, fp32, fp8-block, mixed or other"),
        ("tcp/single/bf16/sparse", "encoding 'sparse' must be full, delta or mixed"),
        ("ipc/rollout_reads/bf16/delta", "encoding delta needs transport tcp or nccl"),
        ("nccl/single/bf16/mixed", "a broadcast reaches every member alike"),
    ],
)
def test_invalid_routes_are_refused_naming_the_word_at_fault(text, why):
    with pytest.raises(ValueError, match=why):
        Route.parse(text)


def test_payload_is_the_quantized_format_or_the_one_dtype_of_the_tensors():
    def manifest(*dtypes, quantization=None):
        metas = [TensorMeta(f"w{i}", (8,), dt) for i, dt in enumerate(dtypes)]
        return make_manifest(metas, version=1, sync_id="s", bucket_bytes=256, quantization=quantization)

    assert payload_of(manifest(torch.bfloat16, torch.bfloat16), "") == "bf16"
    assert payload_of(manifest(torch.float32), "") == "fp32"
    assert payload_of(manifest(torch.float16), "") == "fp16"
    assert payload_of(manifest(torch.bfloat16, torch.float32), "") == "mixed"
    assert payload_of(manifest(torch.int64), "") == "other"
    fp8 = Quantization("fp8", "e4m3", (128, 128))
    assert payload_of(manifest(torch.float8_e4m3fn, torch.float32, quantization=fp8), "fp8-block") == "fp8-block"


def test_encoding_is_who_of_the_prepared_takes_deltas():
    assert encoding_of({"a": 1, "b": 2}, set()) == "full"
    assert encoding_of({"a": 1, "b": 2}, {"a", "b"}) == "delta"
    assert encoding_of({"a": 1, "b": 2}, {"a"}) == "mixed"
    assert encoding_of({}, {"a"}) == "full"  # nobody prepared: nothing goes as a delta


class _Ipc(Session):
    name = "ipc"

    def __init__(self, direction):
        self.direction = direction


class _Tcp(Session):
    name = "tcp"


def test_pick_reads_the_route_off_the_session_and_the_manifest():
    metas = [TensorMeta(f"w{i}", (16,), torch.bfloat16) for i in range(4)]
    single = make_manifest(metas, version=1, sync_id="s", bucket_bytes=256)
    multi = make_manifest(metas, version=1, sync_id="s", bucket_bytes=256, owners=[0, 0, 1, 1])
    assert str(pick(_Tcp(), single, "", {"a": 1}, set())) == "tcp/single/bf16/full"
    assert str(pick(_Tcp(), multi, "", {"a": 1, "b": 1}, {"a"})) == "tcp/multi-sender/bf16/mixed"
    assert str(pick(_Ipc("trainer_writes"), single, "", {"a": 1}, set())) == "ipc/trainer_writes/bf16/full"
    assert str(pick(_Ipc("rollout_reads"), single, "", {"a": 1}, set())) == "ipc/rollout_reads/bf16/full"
