"""The HTTP side of both services, against real in-process services on loopback ports.

Probes and metrics behave as before the move to FastAPI; the trainer's REST mirror answers what
the gRPC admin API answers (same validation, same JSON as `wsctl --json`); both refuse
bodies over the limit before reading them.
"""
from __future__ import annotations

import json
import socket
import time

import pytest
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST
from tests.unit.weightsync.http.rest_helpers import AUTH, TOKEN, http

from weightsync.control.client import channel, trainer_stub
from weightsync.v1 import rollout_pb2, trainer_pb2


# ---- probes and metrics (unchanged behaviour) ----------------------------------------------
def test_probes_and_metrics(services):
    trainer, rollout = services
    for app in (trainer, rollout):
        code, headers, body = http(app.http.port, "/healthz")
        assert (code, body) == (200, "ok\n") and headers["Content-Type"].startswith("text/plain")
        code, _, body = http(app.http.port, "/readyz")
        assert code == 200 and "version" in body
        code, headers, body = http(app.http.port, "/metrics")
        assert code == 200 and headers["Content-Type"] == CONTENT_TYPE_LATEST
        assert "weightsync_weights_version" in body
        code, _, body = http(app.http.port, "/nope")
        assert code == 404 and "/healthz" in body
        code, _, _ = http(app.http.port, "/healthz", body={}, method="POST")
        assert code == 405


def test_readyz_is_503_with_the_reason_when_stale(services):
    _, rollout = services
    state, err = rollout.tx.state, rollout.tx.last_error
    rollout.tx.state, rollout.tx.last_error = rollout_pb2.STALE, "sync x aborted"
    try:
        code, _, body = http(rollout.http.port, "/readyz")
    finally:
        rollout.tx.state, rollout.tx.last_error = state, err
    assert code == 503 and "STALE: sync x aborted" in body


def test_port_clash_fails_at_construction_and_stop_is_bounded():
    from prometheus_client import CollectorRegistry

    from weightsync.http import serve_http

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}.*port"):
            serve_http(f"127.0.0.1:{port}", title="t", registry=CollectorRegistry(), ready=lambda: (True, "ok"))
    srv = serve_http("127.0.0.1:0", title="t", registry=CollectorRegistry(), ready=lambda: (time.sleep(30), "x")[::-1])
    srv.start()
    hung = socket.create_connection(("127.0.0.1", srv.port))
    hung.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")  # its handler sleeps 30 s
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < srv.grace_s + 4
    hung.close()


# ---- auth -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [("/v1/status", None), ("/v1/sync", {"rollout_ids": ["none"]})])
def test_rest_needs_the_token_exactly_once(services, path, body):
    trainer, _ = services
    port = trainer.http.port
    assert http(port, path, body)[0] == 401
    code, headers, text = http(port, path, body, headers={"Authorization": "Bearer wrong"})
    assert code == 401 and headers["WWW-Authenticate"] == "Bearer" and "token" in text
    assert http(port, path, body, headers={"Authorization": TOKEN})[0] == 401  # no "Bearer "
    # one right and one wrong header: refused (the gRPC interceptor would take any match)
    req = (f"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
           "Authorization: Bearer wrong\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        assert s.recv(100).startswith(b"HTTP/1.1 401")
    assert http(port, "/healthz")[0] == 200 and http(port, "/openapi.json")[0] == 200  # probes stay open


# ---- trainer REST mirror ------------------------------------------------------------------
def test_status_is_grpc_getstatus_as_json(services):
    trainer, _ = services
    code, _, body = http(trainer.http.port, "/v1/status", headers=AUTH)
    assert code == 200
    got = json.loads(body)
    with channel(trainer.grpc.address) as ch:
        want = MessageToDict(trainer_stub(ch, TOKEN).GetStatus(trainer_pb2.TrainerStatusRequest()),
                             preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    assert set(got) == set(want)
    for k in ("version", "model_family", "num_parameters", "backend", "origin"):
        assert got[k] == want[k], k
    assert [r["rollout_id"] for r in got["rollouts"]] == ["r1"]


def test_sync_commits_and_reports(services):
    trainer, rollout = services
    code, _, body = http(trainer.http.port, "/v1/sync", body={"rollout_ids": ["r1"], "transport": "tcp"}, headers=AUTH)
    assert code == 200, body
    rep = json.loads(body)
    assert rep["ok"] is True and rep["rollouts"][0]["rollout_id"] == "r1"
    assert rollout.tx.version == trainer.actor.version == int(rep["version"])
    assert rollout.tx.origin == trainer.orch.origin
    code, _, body = http(trainer.http.port, "/v1/sync", method="POST", headers=AUTH)  # no body: all rollouts
    assert code == 200 and json.loads(body)["ok"] is True


@pytest.mark.parametrize("body,status,needle", [
    ({"rollout_ids": ["nope"]}, 404, "nope"),
    ({"transport": "udp"}, 400, "transport"),
    ({"timeout_seconds": -1}, 400, "timeout_seconds"),
    ({"timeout_seconds": "soon"}, 400, "timeout_seconds"),
    ({"rollout_ids": "r1"}, 400, "rollout_ids"),
    ({"bogus": 1}, 400, "bogus"),
])
def test_sync_rejects_bad_bodies_naming_the_field(services, body, status, needle):
    trainer, _ = services
    code, _, text = http(trainer.http.port, "/v1/sync", body=body, headers=AUTH)
    assert code == status and needle in json.loads(text)["detail"], text


def test_malformed_json_is_a_400(services):
    trainer, _ = services
    code, _, text = http(trainer.http.port, "/v1/sync", raw=b"{not json", headers=AUTH)
    assert code == 400 and "detail" in json.loads(text)


def test_openapi_describes_the_api(services):
    trainer, rollout = services
    spec = json.loads(http(trainer.http.port, "/openapi.json")[2])
    assert {"/healthz", "/readyz", "/metrics", "/v1/status", "/v1/sync"} <= set(spec["paths"])
    assert set(spec["components"]["schemas"]["SyncBody"]["properties"]) == {
        "rollout_ids", "transport", "timeout_seconds", "senders", "allow_rollback"}
    spec = json.loads(http(rollout.http.port, "/openapi.json")[2])
    assert {"/healthz", "/readyz", "/metrics"} <= set(spec["paths"]) and "/v1/sync" not in spec["paths"]


def test_oversized_body_is_413_before_it_is_read(services):
    trainer, _ = services
    with socket.create_connection(("127.0.0.1", trainer.http.port), timeout=10) as s:
        s.sendall(b"POST /v1/sync HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {1 << 30}\r\n\r\n{{".encode())
        assert s.recv(100).startswith(b"HTTP/1.1 413")
