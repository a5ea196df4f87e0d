"""The rollout's end of the sync link (weightsync.control.sync_link): authenticate, then answer frames.

Each request runs through the RolloutServicer's own RPC handler, so the link checks exactly what
gRPC does (trainer pin, manifest limits, timeouts) and shares its metrics. Its requests are
bounded like the gRPC server's (`request_limits`, by full method name) and refused on their
length before they are read. At most `max_links` links are open at once; TCP keepalive closes
one whose trainer vanished without closing it, so a dead peer cannot hold a slot for long.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time

import grpc

from weightsync.bus.errors import TransportError
from weightsync.control.grpc_server import MAX_MESSAGE_BYTES
from weightsync.control.sync_link import (
    ACCEPTED,
    METHODS,
    NONCE_BYTES,
    FrameTooLarge,
    frame,
    link_mac,
    read_frame,
    recv_exact,
)

log = logging.getLogger(__name__)

_SERVICE = "/weightsync.v1.Rollout/"
# (level, option, value): probe an idle link after 30 s, drop it after 3 unanswered probes 10 s apart
_KEEPALIVE = (
    (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
    (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 30),
    (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 10),
    (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _LinkContext:
    """What the RPC handlers ask of a grpc.ServicerContext, for a request that came over the link."""

    def __init__(self, peer: str):
        self._peer = peer

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)

    def peer(self) -> str:
        return self._peer

    def is_active(self) -> bool:
        return True


def _keepalive(conn: socket.socket) -> None:
    for level, name, value in _KEEPALIVE:
        opt = getattr(socket, name, None)
        if opt is None:  # not every platform has every option
            continue
        try:
            conn.setsockopt(level, opt, value)
        except OSError:
            pass


class SyncLinkServer:
    def __init__(
        self, servicer, token: str, request_limits: dict[str, int], max_links: int = 4, hello_timeout: float = 10.0
    ):
        self.servicer = servicer
        self.token = token
        self.request_limits = request_limits
        self.max_links = max_links
        self.hello_timeout = hello_timeout
        self._slots = threading.BoundedSemaphore(max_links)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        #: requests answered over links since start (the rest of a sync's calls went over gRPC)
        self.requests = 0

    def serve(self, conn: socket.socket, peer) -> None:
        """Runs on the connection's thread until the peer closes it or the server stops."""
        if not self._slots.acquire(blocking=False):
            log.warning("sync link from %s refused: %d links already open", peer, self.max_links)
            conn.close()
            return
        try:
            with self._lock:
                if self._closed:
                    return
                self._open.add(conn)
            if self._authenticate(conn, peer):
                self._answer(conn, f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
        except TransportError:  # the trainer closed the link (it stopped, or dropped it after a timeout)
            log.debug("sync link from %s closed by the trainer", peer)
        except (OSError, TimeoutError, ValueError) as exc:  # the peer went away or broke the protocol
            log.info("sync link from %s dropped: %s", peer, exc)
        finally:
            conn.close()
            self._slots.release()
            with self._lock:  # last: while a link is listed open, its slot is still taken
                self._open.discard(conn)

    def _authenticate(self, conn: socket.socket, peer) -> bool:
        nonce = os.urandom(NONCE_BYTES)
        conn.settimeout(self.hello_timeout)
        conn.sendall(nonce)
        mac = recv_exact(conn, 32, time.monotonic() + self.hello_timeout)
        if not hmac.compare_digest(mac, link_mac(self.token, nonce)):
            log.warning("sync link from %s rejected: bad token", peer)
            return False
        conn.sendall(ACCEPTED)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(conn)
        conn.settimeout(None)  # a link waits for the next sync as long as the trainer keeps it
        return True

    def _limit(self, kind: int) -> int:
        name = METHODS[kind][0] if kind in METHODS else ""
        return self.request_limits.get(_SERVICE + name, MAX_MESSAGE_BYTES)

    def _answer(self, conn: socket.socket, peer: str) -> None:
        while True:
            try:
                kind, payload = read_frame(conn, None, self._limit)
            except FrameTooLarge as exc:  # its bytes are left unread: answer, then drop the link
                name = METHODS[exc.kind][0] if exc.kind in METHODS else f"method {exc.kind}"
                conn.sendall(
                    self._error(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{_SERVICE}{name}: request of {exc.size} bytes exceeds this server's "
                        f"limit of {exc.limit} bytes for it",
                    )
                )
                return
            conn.sendall(self._dispatch(kind, payload, peer))

    def _dispatch(self, kind: int, payload: bytes, peer: str) -> bytes:
        if kind not in METHODS:
            return self._error(
                grpc.StatusCode.UNIMPLEMENTED,
                f"sync link: no method {kind} (known: {', '.join(n for n, _, _ in METHODS.values())})",
            )
        name, request_type, _ = METHODS[kind]
        try:
            request = request_type.FromString(payload)
        except Exception as exc:  # protobuf DecodeError: the client's error, as over gRPC
            return self._error(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{_SERVICE}{name}: the request is not a valid protobuf message ({exc})",
            )
        try:
            response = getattr(self.servicer, name)(request, _LinkContext(peer))
        except _Aborted as exc:
            return self._error(exc.code, exc.details)
        except Exception as exc:  # a handler bug: answered as gRPC would, and logged with its trace
            log.exception("sync link: %s failed", name)
            return self._error(grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")
        self.requests += 1
        return frame(0, response.SerializeToString())

    @staticmethod
    def _error(code: grpc.StatusCode, details: str) -> bytes:
        return frame(code.value[0], details.encode("utf-8", errors="replace"))

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._open)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked reading it
            except OSError:
                pass
