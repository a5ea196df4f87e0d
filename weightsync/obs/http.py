"""HTTP endpoints for kubelet and Prometheus: /healthz, /readyz, /metrics."""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from weightsync.config import parse_host_port

log = logging.getLogger(__name__)


class HttpEndpoints:
    """`ready()` returns (ready, reason); liveness only says the process answers."""

    def __init__(self, address: str, registry: CollectorRegistry, ready: Callable[[], tuple[bool, str]],
                 status: Callable[[], dict] | None = None):
        host, port = parse_host_port("http_address", address)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # probes every few seconds would flood the log
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError) as exc:
                    # A probe that gave up (kubelet's timeout, a busy start-up) hung up first: the
                    # answer has no reader left, which is the client's business, not a server fault.
                    log.debug("HTTP %s: client at %s hung up before the answer (%s)", self.path,
                              self.client_address[0], exc)

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                elif path == "/readyz":
                    ok, reason = outer.ready()
                    self._send(200 if ok else 503, (reason + "\n").encode(), "text/plain")
                elif path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/status" and outer.status is not None:
                    self._send(200, json.dumps(outer.status()).encode(), "application/json")
                else:
                    self._send(404, b"not found: try /healthz, /readyz, /metrics\n", "text/plain")

        self.ready = ready
        self.status = status
        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise RuntimeError(f"cannot listen on http_address {address}: {exc.strerror} (pick another port)") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
