"""The rollout's end of the sync link (weightsync.control.sync_link): authenticate, then answer frames.

Each request runs through the RolloutServicer's own RPC handler, so the link checks exactly what
gRPC does (trainer pin, manifest limits, timeouts) and shares its metrics. Its requests are
bounded like the gRPC server's (`request_limits`, by full method name) and refused on their
length before they are read. At most `max_links` authenticated links are open at once; TCP
keepalive closes one whose trainer vanished without closing it, so a dead peer cannot hold a slot
for long. A link still in its handshake holds no slot: it waits in a pre-auth budget of its own
(weightsync.bus.tcp.preauth.PreAuthBudget: `max_handshakes` in all, a few per address; over a cap the
oldest link not making progress is evicted, never the newest refused) and must prove the token within
`hello_timeout` seconds in total, so silent peers cannot keep the trainer off, from any address.

A link opened with LINK_MAGIC_BEATS gets a BEAT frame as soon as each request is read, then BEAT frames
while it is handled (one thread, _Beater, beats for every such link): the liveness signal the trainer
tells "slow" from "gone" by, and within milliseconds "has it" from "silent". Between requests (while a
sync streams on the bus) the link thread answers each PING frame with a BEAT at once: it never waits
on the apply, so a rollout blocked draining generation requests still answers, and a stopped one does not.
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
from weightsync.bus.tcp.preauth import PreAuthBudget
from weightsync.control.grpc_server import MAX_MESSAGE_BYTES
from weightsync.control.sync_link import (
    ACCEPTED,
    BEAT,
    BEAT_PERIOD_S,
    METHODS,
    NONCE_BYTES,
    PING,
    FrameTooLarge,
    frame,
    link_mac,
    read_frame,
    recv_exact,
)

log = logging.getLogger(__name__)

_SERVICE = "/weightsync.v1.Rollout/"
#: the BEAT frame that acknowledges a request as soon as it is read
_ACK = frame(BEAT, b"")
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
        #: run once the answer went out, as gRPC runs a call's callbacks when it ends
        self.callbacks: list = []

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def run_callbacks(self) -> None:
        for fn in self.callbacks:
            try:
                fn()
            except Exception:  # a callback's failure must not take the link down with it
                log.exception("sync link: a callback after the answer failed")

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


class _Beater:
    """One thread that sends a BEAT frame, every BEAT_PERIOD_S, on each link whose request is being handled."""

    def __init__(self, period: float = BEAT_PERIOD_S):
        self.period = period
        self._busy: dict[socket.socket, tuple[threading.Lock, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, conn: socket.socket, send_lock: threading.Lock) -> None:
        """A request on `conn` is being handled: acknowledge it now, then beat until `end`."""
        # at once: a trainer waiting on several rollouts tells, within milliseconds, that this one
        # has the request in hand (weightsync.publisher.straggler)
        with send_lock:
            conn.sendall(_ACK)
        with self._lock:
            self._busy[conn] = (send_lock, time.monotonic() + self.period)
            if self._thread is None:  # started by the first link that asks for beats
                self._thread = threading.Thread(target=self._run, name="sync-link-beats", daemon=True)
                self._thread.start()

    def end(self, conn: socket.socket) -> None:
        with self._lock:
            self._busy.pop(conn, None)

    def _run(self) -> None:
        beat = frame(BEAT, b"")
        while not self._stop.wait(self.period / 2):
            now = time.monotonic()
            with self._lock:
                due = [(c, lock) for c, (lock, at) in self._busy.items() if at <= now]
                for c, lock in due:
                    self._busy[c] = (lock, now + self.period)
            for conn, send_lock in due:
                with send_lock:  # never inside an answer; and only while that request is still handled
                    with self._lock:
                        if conn not in self._busy:
                            continue
                    try:
                        sent = conn.send(beat, socket.MSG_DONTWAIT)
                        if sent < len(beat):  # the trainer is reading (it waits for this answer)
                            conn.sendall(beat[sent:])
                    except OSError:  # a full buffer skips a beat; a closed link is the link thread's to see
                        pass

    def stop(self) -> None:
        self._stop.set()


class SyncLinkServer:
    def __init__(
        self,
        servicer,
        token: str,
        request_limits: dict[str, int],
        max_links: int = 4,
        hello_timeout: float = 10.0,
        max_handshakes: int = 64,
        max_handshakes_per_address: int = 8,
    ):
        self.servicer = servicer
        self.token = token
        self.request_limits = request_limits
        self.max_links = max_links
        self.hello_timeout = hello_timeout
        self._slots = threading.BoundedSemaphore(max_links)
        self.handshakes = PreAuthBudget(max_handshakes, max_handshakes_per_address, "sync link")
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._beater = _Beater()
        #: requests answered over links since start (the rest of a sync's calls went over gRPC)
        self.requests = 0

    def serve_with_beats(self, conn: socket.socket, peer) -> None:
        """serve() for a link opened with LINK_MAGIC_BEATS."""
        self.serve(conn, peer, beats=True)

    def serve(self, conn: socket.socket, peer, beats: bool = False) -> None:
        """Runs on the connection's thread until the peer closes it or the server stops."""
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        slot = False
        try:
            with self._lock:
                if self._closed:
                    return
                self._open.add(conn)
            if not self._handshake(conn, peer, address):
                return
            if not self._slots.acquire(blocking=False):
                log.warning("sync link from %s refused: %d links already open (max_sync_links)", peer, self.max_links)
                return
            slot = True
            self._accept(conn)
            self._answer(conn, f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer), beats)
        except TransportError:  # the trainer closed the link (it stopped, or dropped it after a timeout)
            log.debug("sync link from %s closed by the trainer", peer)
        except (OSError, TimeoutError, ValueError) as exc:  # the peer went away or broke the protocol
            log.info("sync link from %s dropped: %s", peer, exc)
        finally:
            conn.close()
            if slot:
                self._slots.release()
            with self._lock:  # last: while a link is listed open, its slot is still taken
                self._open.discard(conn)

    def _handshake(self, conn: socket.socket, peer, address: str) -> bool:
        """The token proved within `hello_timeout` in total, under the pre-auth budget (no link slot)."""
        ticket = self.handshakes.enter(conn, address, needs=32)  # its one stage: the MAC
        try:
            return self._authenticate(conn, peer)
        except (OSError, TimeoutError, ValueError, TransportError) as exc:
            if not ticket.evicted:
                raise
            log.debug("sync link from %s evicted: %s", peer, exc)
            return False
        finally:
            self.handshakes.leave(ticket)

    def _authenticate(self, conn: socket.socket, peer) -> bool:
        nonce = os.urandom(NONCE_BYTES)
        deadline = time.monotonic() + self.hello_timeout
        conn.settimeout(self.hello_timeout)
        conn.sendall(nonce)
        mac = recv_exact(conn, 32, deadline)
        if not hmac.compare_digest(mac, link_mac(self.token, nonce)):
            log.warning("sync link from %s rejected: bad token", peer)
            return False
        return True

    @staticmethod
    def _accept(conn: socket.socket) -> None:
        conn.sendall(ACCEPTED)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(conn)
        conn.settimeout(None)  # a link waits for the next sync as long as the trainer keeps it

    def _limit(self, kind: int) -> int:
        name = METHODS[kind][0] if kind in METHODS else ""
        return self.request_limits.get(_SERVICE + name, MAX_MESSAGE_BYTES)

    def _answer(self, conn: socket.socket, peer: str, beats: bool = False) -> None:
        send_lock = threading.Lock()  # an answer and a beat never interleave
        while True:
            try:
                kind, payload = read_frame(conn, None, self._limit)
            except FrameTooLarge as exc:  # its bytes are left unread: answer, then drop the link
                name = METHODS[exc.kind][0] if exc.kind in METHODS else f"method {exc.kind}"
                with send_lock:
                    conn.sendall(
                        self._error(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"{_SERVICE}{name}: request of {exc.size} bytes exceeds this server's "
                            f"limit of {exc.limit} bytes for it",
                        )
                    )
                return
            if kind == PING:  # liveness between requests (during the stream): answered at once
                with send_lock:
                    conn.sendall(_ACK)
                continue
            if beats:
                self._beater.begin(conn, send_lock)
            context = _LinkContext(peer)
            try:
                answer = self._dispatch(kind, payload, context)
            finally:
                if beats:
                    self._beater.end(conn)
            with send_lock:
                conn.sendall(answer)
            context.run_callbacks()

    def _dispatch(self, kind: int, payload: bytes, context: _LinkContext) -> bytes:
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
            response = getattr(self.servicer, name)(request, context)
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
        self._beater.stop()
        with self._lock:
            self._closed = True
            conns = list(self._open)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked reading it
            except OSError:
                pass
