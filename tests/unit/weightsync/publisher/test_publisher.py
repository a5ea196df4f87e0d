"""weightsync.publisher.Publisher: the declaration, the checks on each sync's tensors, the security
defaults, and syncs into real in-process rollouts (bit-exact, with a token)."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from tests.support.local_apps import start_rollout
from weightsync.config import ConfigError
from weightsync.control.client import channel, trainer_stub
from weightsync.local.procs import http_get
from weightsync.publisher import Auth, DeclaredModel, Publisher, SyncFailed, SyncOptions
from weightsync.v1 import rollout_pb2, trainer_pb2

LOOPBACK = dict(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0")
SPEC = {"a.weight": ((4, 3), torch.float32), "b.bias": ((5,), "bfloat16")}


def tensors(**over):
    out = {"a.weight": torch.ones(4, 3), "b.bias": torch.zeros(5, dtype=torch.bfloat16)}
    out.update(over)
    return list(out.items())


@pytest.fixture
def pub():
    p = Publisher(SPEC, **LOOPBACK).start()
    yield p
    p.close()


def test_a_dict_declares_names_shapes_and_dtypes_in_order(pub):
    metas = pub.source.export_metas()
    assert [(m.name, m.shape, m.dtype) for m in metas] == [
        ("a.weight", (4, 3), torch.float32),
        ("b.bias", (5,), torch.bfloat16),
    ]
    assert pub.source.family == "" and pub.source.num_parameters() == 17


@pytest.mark.parametrize(
    "given, match",
    [
        (tensors(**{"c.weight": torch.ones(1)}), r"^c\.weight: not a declared tensor"),
        (tensors(**{"a.weight": torch.ones(3, 4)}), r"^a\.weight: shape \(3, 4\), declared \(4, 3\)"),
        (tensors(**{"a.weight": torch.ones(4, 3, dtype=torch.float16)}), r"^a\.weight: dtype torch\.float16"),
        (tensors()[:1], r"^b\.bias: declared but not given"),
        (tensors() + tensors()[:1], r"^a\.weight: given twice"),
    ],
)
def test_a_tensor_that_does_not_match_the_declaration_is_refused_by_name_before_anything_moves(pub, given, match):
    with pytest.raises(ValueError, match=match):
        pub.sync(given)
    assert pub.version == 0  # nothing published, no version spent


def test_without_a_rollout_a_sync_bumps_the_version_and_reports_not_ok_without_raising(pub):
    report = pub.sync(tensors())
    assert (report.ok, report.version, len(report.rollouts)) == (False, 1, 0)
    assert pub.sync(tensors()).version == pub.version == 2
    # nothing of the caller's is kept between syncs (snapshot=False): their tensors change after sync()
    with pytest.raises(RuntimeError, match="holds no tensors"):
        next(pub.source.export_tensors())


def test_an_exposed_address_needs_a_token():
    with pytest.raises(ConfigError, match="without a token"):
        Publisher(SPEC, grpc_address="0.0.0.0:0", http_address="127.0.0.1:0")
    p = Publisher(SPEC, grpc_address="0.0.0.0:0", http_address="127.0.0.1:0", auth=Auth(token="t"))
    port = p.http_port
    p.close()  # never started: its ports are released all the same
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_bad_options_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="transport"):
        Publisher(SPEC, options=SyncOptions(transport="carrier-pigeon"), **LOOPBACK)
    with pytest.raises(ValueError, match="no config.json"):
        Publisher(str(tmp_path), **LOOPBACK)
    with pytest.raises(ValueError, match=r"model\['x'\]"):
        Publisher({"x": (3,)}, **LOOPBACK)
    with pytest.raises(ValueError, match="SyncOptions.sync_encoding='sometimes' must be full, delta or auto"):
        Publisher(SPEC, options=SyncOptions(sync_encoding="sometimes"), **LOOPBACK)
    with pytest.raises(ValueError, match="sync_encoding='delta' is carried by transports tcp or nccl only"):
        Publisher(SPEC, options=SyncOptions(sync_encoding="delta", transport="ipc"), **LOOPBACK)
    with pytest.raises(ValueError, match="delta_base_bytes=-1"):
        Publisher(SPEC, options=SyncOptions(delta_base_bytes=-1), **LOOPBACK)
    with pytest.raises(ValueError, match="delta_link_gbps=-5 must be >= 0"):
        Publisher(SPEC, options=SyncOptions(delta_link_gbps=-5), **LOOPBACK)


def test_an_hf_config_declares_the_checkpoint_tensors(tmp_path):
    from transformers import AutoModelForCausalLM

    from weightsync.models import resolve_model

    config, _ = resolve_model("tiny-qwen2-tied")
    config.save_pretrained(tmp_path)
    p = Publisher(DeclaredModel(str(tmp_path), dtype="bfloat16"), **LOOPBACK)
    try:
        sd = AutoModelForCausalLM.from_config(config).state_dict()
        want = [(n, tuple(t.shape)) for n, t in sd.items() if n != "lm_head.weight"]  # tied: not in a checkpoint
        assert [(m.name, m.shape) for m in p.source.export_metas()] == want
        assert {m.dtype for m in p.source.export_metas()} == {torch.bfloat16}
        assert p.source.family == "qwen2-tied"
    finally:
        p.close()


def _rollout(token: str, rid: str):
    return start_rollout(rid, auth_token=token)


def _register(pub, stub, app, rid):
    return stub.RegisterRollout(
        trainer_pb2.RegisterRolloutRequest(rollout_id=rid, address=app.grpc.address, model_family=app.servicer.family)
    )


def test_syncs_into_real_rollouts_are_bit_exact_with_auth_on_and_a_snapshot_catches_up_a_late_one():
    from weightsync.models import resolve_model

    token = "s3cret"
    config, _ = resolve_model("tiny-qwen2")
    pub = Publisher(
        config, auth=Auth(token=token), snapshot=True, options=SyncOptions(bucket_bytes=1 << 20), **LOOPBACK
    ).start()
    first = _rollout(token, "r1")
    late = None
    try:
        ch = channel(pub.address)
        with pytest.raises(grpc.RpcError) as ei:  # no token: refused
            trainer_stub(ch, "", 10).GetStatus(trainer_pb2.TrainerStatusRequest())
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub = trainer_stub(ch, token, 30)
        # nothing published yet: no catch-up is started for it (it would have nothing to send)
        assert not _register(pub, stub, first, "r1").sync_scheduled
        g = torch.Generator().manual_seed(0)
        metas = pub.source.export_metas()
        for version in (1, 2):
            given = {m.name: torch.randn(m.shape, generator=g) for m in metas}
            report = pub.sync(given.items())
            assert report.ok and report.version == version and [r.rollout_id for r in report.rollouts] == ["r1"]
            assert first.tx.version == version and first.tx.state == rollout_pb2.SERVING
            for name, t in given.items():
                assert torch.equal(first.engine._target(name), t), name
        st = stub.GetStatus(trainer_pb2.TrainerStatusRequest())
        assert (st.version, st.backend, st.model_family, st.rollouts[0].version) == (2, "external", "qwen2", 2)
        # the HTTP side, as trainer-svc's: open probes and metrics, the REST mirror behind the token
        assert http_get(pub.http_port, "/readyz") == (200, "weights at version 2\n")
        assert 'weightsync_weights_version{role="trainer"} 2.0' in http_get(pub.http_port, "/metrics")[1]
        assert 'weightsync_syncs_total{outcome="ok",role="trainer"} 2.0' in http_get(pub.http_port, "/metrics")[1]
        assert http_get(pub.http_port, "/v1/status")[0] == 401

        # a rollout that registers between syncs is caught up from the snapshot (auto catch-up)
        late = _rollout(token, "r2")
        assert _register(pub, stub, late, "r2").sync_scheduled
        deadline = time.monotonic() + 60
        while late.tx.version != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert late.tx.version == 2, pub.host.registry.get("r2").last_error
        for name, t in given.items():
            assert torch.equal(late.engine._target(name), t), name
    finally:
        for app in (first, late):
            if app is not None:
                app.stop()
        pub.close()


def test_a_rollout_that_does_not_commit_raises_sync_failed_with_the_report():
    pub = Publisher(SPEC, **LOOPBACK).start()
    try:
        pub.host.registry.upsert("gone", "127.0.0.1:1")  # nothing listens there
        with pytest.raises(SyncFailed, match="gone") as ei:
            pub.sync(tensors(), timeout_s=5)
        assert not ei.value.report.ok and ei.value.report.version == 1
        report = pub.sync(tensors(), timeout_s=5, raise_on_failure=False)
        assert not report.ok and report.rollouts[0].rollout_id == "gone"
    finally:
        pub.close()


@pytest.mark.parametrize("encoding", ["auto", "full"])
def test_sync_encoding_auto_sends_only_what_changed_and_full_every_byte_both_exact(encoding):
    from weightsync.models import resolve_model

    config, _ = resolve_model("tiny-qwen2")
    pub = Publisher(config, options=SyncOptions(bucket_bytes=1 << 20, sync_encoding=encoding), **LOOPBACK).start()
    app = _rollout("", "r")
    try:
        _register(pub, trainer_stub(channel(pub.address), "", 30), app, "r")
        g = torch.Generator().manual_seed(0)
        given = {m.name: torch.randn(m.shape, generator=g) for m in pub.source.export_metas()}
        assert pub.sync(given.items()).rollouts[0].encoding == "full"  # no base yet
        for t in given.values():  # 2 % of the values change
            mask = torch.rand(t.shape, generator=g) < 0.02
            t[mask] += 1.0
        report = pub.sync(given.items())
        (r,) = report.rollouts
        if encoding == "auto":
            assert r.encoding == "delta" and r.wire_bytes <= 0.15 * report.bytes, (r.encoding, r.wire_bytes)
        else:
            assert r.encoding == "full" and r.wire_bytes >= report.bytes
            assert pub.host.orch.delta.held_bytes() == 0  # full keeps no copy
        for name, t in given.items():
            assert torch.equal(app.engine._target(name), t), name
    finally:
        app.stop()
        pub.close()
