"""What an HTTP client costs before it is authenticated, and how long a slow one is waited for.

Loopback only; every wait is a poll with a deadline. Before the middleware, an unauthenticated body
was read (and parsed) in full before the 401, and a client that sent half a header kept its
connection forever.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from fastapi import APIRouter
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from tests.unit.weightsync.http.rest_helpers import AUTH, TOKEN, error_message, http
from weightsync.http.app import make_app
from weightsync.http.server import HEADER_TIMEOUT_S, HttpServer


def _read_until_closed(s: socket.socket, deadline_s: float) -> tuple[bytes, bool]:
    """(bytes read, whether the peer closed) within `deadline_s`."""
    s.settimeout(0.05)
    got, end = b"", time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got, True
        if not chunk:
            return got, True
        got += chunk
    return got, False


class Body(BaseModel):
    x: int


def _echo_router() -> APIRouter:
    r = APIRouter(prefix="/v1")

    @r.post("/echo")
    def echo(body: Body) -> dict:
        return {"x": body.x}

    return r


@pytest.fixture
def small_server():
    """A service app with a token, a 1 s header deadline and a 1 s body deadline."""
    app = make_app("t", CollectorRegistry(), lambda: (True, "ok"), [_echo_router()], token=TOKEN, body_timeout_s=1.0)
    srv = HttpServer("127.0.0.1:0", app, header_timeout_s=1.0)
    srv.start()
    yield srv
    srv.stop()


def _post_head(path: str, length: int, auth: str | None = None) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
        + (f"Authorization: {auth}\r\n" if auth else "")
        + "\r\n"
    ).encode()


# ---- before auth ------------------------------------------------------------------------------
def test_unauthenticated_16mib_body_gets_401_before_it_is_read(services):
    _, rollout = services
    port = rollout.http.port
    # 48 clients each declare 16 MiB and send 64 KiB: each gets its 401 at once, from the headers,
    # and its connection is closed (the rest of its body is never waited for)
    socks = []
    try:
        t0 = time.monotonic()
        for _ in range(48):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(_post_head("/v1/completions", 16 << 20) + b"{" * (64 << 10))
            socks.append(s)
        for s in socks:
            got, closed = _read_until_closed(s, 5.0)
            assert got.startswith(b"HTTP/1.1 401") and closed, got[:200]
            assert b"www-authenticate: bearer" in got.lower()
            assert "token" in error_message(got.split(b"\r\n\r\n", 1)[1].decode())
        assert time.monotonic() - t0 < 10
        # the service answered probes throughout and still does, promptly
        t1 = time.monotonic()
        assert http(port, "/healthz")[0] == 200 and time.monotonic() - t1 < 1.0
    finally:
        for s in socks:
            s.close()


def test_unknown_v1_route_without_token_is_401_not_404(services):
    _, rollout = services
    code, headers, text = http(rollout.http.port, "/v1/nothing-here")
    assert code == 401 and headers["WWW-Authenticate"] == "Bearer" and "token" in error_message(text)
    code, _, text = http(rollout.http.port, "/v1/nothing-here", headers=AUTH)
    assert code == 404 and "/healthz" in error_message(text)


def test_open_routes_need_no_token(services):
    for app in services:
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert http(app.http.port, path)[0] == 200, path


# ---- slow clients -----------------------------------------------------------------------------
def test_half_a_header_is_dropped_within_the_header_deadline(small_server):
    port = small_server.port
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
    try:
        t0 = time.monotonic()
        for s in stalled:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: the headers never end
        # one more trickles a byte every 0.1 s: bytes that arrive do not extend the deadline
        trickler = socket.create_connection(("127.0.0.1", port), timeout=5)
        stalled.append(trickler)
        trickler.sendall(b"GET /healthz HTTP/1.1\r\n")
        trickler.settimeout(0.1)
        closed_at = None
        while time.monotonic() - t0 < 5.0 and closed_at is None:
            try:
                trickler.sendall(b"X")
                if trickler.recv(1) == b"":
                    closed_at = time.monotonic()
            except TimeoutError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                closed_at = time.monotonic()
        assert closed_at is not None and closed_at - t0 < 1.0 + 1.5, "the trickling client was never dropped"
        for s in stalled[:-1]:
            _, closed = _read_until_closed(s, max(0.1, t0 + 3.0 - time.monotonic()))
            assert closed, "a half-header client was not dropped within the deadline"
        assert http(port, "/healthz")[0] == 200  # the server itself is fine
    finally:
        for s in stalled:
            s.close()


def test_keep_alive_connection_gets_a_fresh_header_deadline_per_request(small_server):
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=5) as s:
        for _ in range(3):  # 3 requests over 1.8 s on one connection, each within its own deadline
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while not got.endswith(b"ok\n"):
                got += s.recv(1024)
            assert got.startswith(b"HTTP/1.1 200")
            time.sleep(0.6)


def test_default_server_has_a_header_deadline(services):
    _, rollout = services
    cfg = rollout.http.server.config
    assert 0 < HEADER_TIMEOUT_S <= 30 and cfg.http.__name__ == "HeaderDeadlineH11"
    assert cfg.timeout_keep_alive <= 30 and cfg.h11_max_incomplete_event_size == 16 << 10


def test_trickled_body_is_408_after_the_body_deadline(small_server):
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=5) as s:
        t0 = time.monotonic()
        s.sendall(_post_head("/v1/echo", 100, f"Bearer {TOKEN}") + b'{"x": ')
        got, closed = _read_until_closed(s, 5.0)
        assert got.startswith(b"HTTP/1.1 408") and closed, got[:200]
        assert "body" in error_message(got.split(b"\r\n\r\n", 1)[1].decode())
        assert time.monotonic() - t0 < 1.0 + 1.5


def test_authenticated_requests_still_work(small_server):
    code, _, text = http(small_server.port, "/v1/echo", body={"x": 3}, headers=AUTH)
    assert code == 200 and json.loads(text) == {"x": 3}
    code, _, text = http(small_server.port, "/v1/echo", body={"x": "three"}, headers=AUTH)
    assert code == 400 and "x" == json.loads(text)["error"]["param"]
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=5) as s:  # chunked over the limit
        s.sendall(
            b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        block = b"a" * (1 << 20)
        try:
            for _ in range(17):
                s.sendall(f"{len(block):x}\r\n".encode() + block + b"\r\n")
        except (ConnectionResetError, BrokenPipeError):
            pass
        got, _ = _read_until_closed(s, 5.0)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]


# ---- the schema says what the app does -------------------------------------------------------
def test_openapi_declares_bearer_auth_and_the_real_status_codes(services):
    trainer, rollout = services
    for app in (trainer, rollout):
        spec = json.loads(http(app.http.port, "/openapi.json")[2])
        scheme = spec["components"]["securitySchemes"]["bearer"]
        assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
        assert "HTTPValidationError" not in spec["components"]["schemas"]
        assert set(spec["components"]["schemas"]["ErrorBody"]["properties"]) == {"error"}
        for path, item in spec["paths"].items():
            for method, op in item.items():
                assert "422" not in op["responses"], (path, method)
                protected = path.startswith("/v1/")
                assert ("security" in op) == protected, (path, method)
                if protected:
                    assert op["responses"]["401"]["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorBody"
                    }
                if "requestBody" in op:
                    assert {"400", "413"} <= set(op["responses"]), (path, method)
    spec = json.loads(http(rollout.http.port, "/openapi.json")[2])
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])
    assert "text/event-stream" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
