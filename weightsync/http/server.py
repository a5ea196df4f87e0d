"""uvicorn in a background thread, on a socket bound up front.

The socket is bound in the constructor so a port clash fails the service at start-up, in
milliseconds and with the address in the message, instead of as a log line from a thread.
Every wait on the way down is bounded: a request that does not finish within the grace period
is cut off rather than holding the process. Every wait on a client is bounded too: its request's
headers within `header_timeout_s` (weightsync/http/protocol.py), an idle keep-alive connection
within `KEEP_ALIVE_S`, a body within the body deadline (weightsync/http/limits.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from weightsync.config import parse_host_port

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5


class HttpServer:
    def __init__(self, address: str, app, grace_s: float = 2.0, header_timeout_s: float = HEADER_TIMEOUT_S):
        host, port = parse_host_port("http_address", address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # TIME_WAIT from a previous run must not block a restart; on Linux this still refuses a
        # second listener on the same port (that needs SO_REUSEPORT, which we leave off).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise RuntimeError(
                f"cannot listen on http_address {address}: {exc.strerror} (is the port in use? pick another port)"
            ) from None
        self.sock = sock
        self.app = app
        self.port = sock.getsockname()[1]
        self.grace_s = grace_s
        # Set on stop: long handlers (a completion) watch it and end their work early.
        self.stopping = threading.Event()
        app.state.stopping = self.stopping
        import uvicorn  # lazy: only the services need it, not wsctl

        from weightsync.http.protocol import MAX_HEADER_BYTES, header_deadline_protocol

        # log_config=None keeps the service's own logging setup; access logs would log every probe.
        # h11 with a header deadline, whatever else is installed (httptools would have none); no websockets.
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=grace_s,
            timeout_keep_alive=KEEP_ALIVE_S,
            http=header_deadline_protocol(header_timeout_s),
            ws="none",
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    def include(self, router) -> None:
        """Add a service's routes once the objects behind them exist (before `start`)."""
        self.app.include_router(router)
        self.app.openapi_schema = None  # rebuilt with the new routes on the next /openapi.json

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # SystemExit from uvicorn included: say so, the thread would die silently
            log.error("HTTP server on port %d stopped: %r", self.port, exc)

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"HTTP server on port {self.port} did not start within {timeout:.0f}s")

    def stop(self) -> None:
        self.stopping.set()
        self.server.should_exit = True
        self._thread.join(self.grace_s + 1.0)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(2.0)
            if self._thread.is_alive():
                log.error(
                    "HTTP server on port %d did not stop within %.0fs; leaving its daemon thread",
                    self.port,
                    self.grace_s + 3.0,
                )
        self.sock.close()
