"""The trainer's end of the sync link (weightsync.control.sync_link) to one rollout.

Opened on first use, after a PrepareSync answer over gRPC named the link's address, and kept
across syncs; one request at a time. `call` answers as the orchestrator's gRPC call does
((response, "") or (None, "CODE: details")), so a sync cannot tell which path a call took, except
that it is faster. LinkDown means the request never reached the rollout (no connection, refused,
or a link found closed before sending): the caller sends it over gRPC instead. A failure after the
request went out is the call's failure, as a broken gRPC call's would be: a commit is never sent twice.

The link is opened with LINK_MAGIC_BEATS: while the rollout handles a request it beats, so a call
given a `liveness` waits for the answer as long as the beats keep coming (up to its timeout) and
gives up after `liveness` seconds of silence: the rollout is gone (stopped, hung, unreachable), and
`silent` says so until it answers again. The rollout beats once as soon as it reads a request, so
`last_heard` tells a sync, within milliseconds, which rollouts have its request in hand
(weightsync.publisher.straggler). A link whose handshake goes unanswered is silent too.

Between calls (while the sync streams on the bus) `ping` asks the rollout for a BEAT and reads the
ones it already answered, without ever blocking: `last_heard` then tells a stalled stream's "slow"
(its link still answers) from "gone" (weightsync.publisher.stream_liveness). The next call reads
whatever answers to pings are still in flight before it sends its request.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from weightsync.bus.errors import TransportError
from weightsync.config import parse_host_port
from weightsync.control.sync_link import (
    ACCEPTED,
    BEAT,
    LINK_MAGIC_BEATS,
    METHODS,
    NONCE_BYTES,
    NUMBER_OF,
    PING,
    frame,
    link_mac,
    read_frame,
    recv_exact,
    status_code,
    whole_frames,
)

log = logging.getLogger(__name__)

#: a link that could not be opened is not tried again for this long (gRPC meanwhile): it may be
#: black-holed (each try costs the connect timeout) or refuse the token
RETRY_AFTER_S = 60.0
#: ... unless the connection was refused: the rollout is down (restarting), a try costs nothing
RETRY_REFUSED_S = 1.0
_CONNECT_TIMEOUT_S = 2.0
_PING = frame(PING, b"")
#: at most this many bytes of answered pings are read at once (each is a 5-byte BEAT frame)
_DRAIN_BYTES = 64 << 10


class LinkDown(Exception):
    """The request did not reach the rollout; it may be sent over gRPC."""


class _Silent(Exception):
    """The rollout accepted the connection but never answered the handshake: it is gone, not refusing."""


class _Rejected(Exception):
    """The rollout closed the link in its handshake: a wrong token, no link on this port, or no room."""


def _ready(sock: socket.socket, events: int) -> bool:
    """Whether `events` are pending now (or the socket is closed).

    poll, not select: a trainer with many rollouts has descriptors past select's 1024."""
    poller = select.poll()
    try:
        poller.register(sock, events | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):  # a closed socket (fileno -1)
        return True


def _readable(sock: socket.socket) -> bool:
    """Whether a read would not block (data, or the rollout closed the link; or the socket is closed)."""
    return _ready(sock, select.POLLIN)


def _drain(sock: socket.socket) -> tuple[int, bool]:
    """Read the whole frames an idle link holds (the rollout speaks between calls only to answer a
    PING), never blocking: (frames read, whether the link is still usable). A link the rollout closed,
    or that holds only part of a frame, is not: its next call could misread it."""
    frames = 0
    while _readable(sock):
        try:
            data = sock.recv(_DRAIN_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return frames, True
        except OSError:
            return frames, False
        if not data:
            return frames, False  # closed by the rollout
        n, nbytes = whole_frames(data)
        if not n:
            return frames, False  # part of a frame: usable again only once the rest came, so not now
        try:
            sock.recv_into(memoryview(bytearray(nbytes)), nbytes, socket.MSG_WAITALL)  # already here
        except OSError:
            return frames, False
        frames += n
    return frames, True


class SyncLinkClient:
    def __init__(self, address: str, token: str):
        self.address = address
        self.host, self.port = parse_host_port("sync_link", address)
        self.token = token
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        #: time.monotonic() before which the link is not tried (after it could not be opened)
        self.retry_at = 0.0
        #: the rollout went silent (no answer, no beat, within a call's liveness): it is gone until it answers
        self.silent = False
        #: time.monotonic() of the last frame the rollout sent (its handshake, a beat, an answer)
        self.last_heard = 0.0

    def usable(self) -> bool:
        return time.monotonic() >= self.retry_at

    def call(self, method: str, request, timeout: float, liveness: float | None = None):
        """(response, "") or (None, "CODE: details"); LinkDown if the request was not sent.

        `liveness`: give up after this many seconds without an answer or a beat (None: wait `timeout`)."""
        return self.send(method, request, timeout, liveness)()

    def send(self, method: str, request, timeout: float, liveness: float | None = None) -> Callable[[], tuple]:
        """`call` in two halves: the request goes out now, and the function returned reads its answer
        ((response, "") or (None, "CODE: details")), so the caller's own work runs in between on its own
        thread. The link carries one request at a time: it stays taken until that function has run, which
        the caller must call (also when its work in between failed). LinkDown if the request was not sent."""
        _, _, response_type = METHODS[NUMBER_OF[method]]
        deadline = time.monotonic() + timeout
        self._lock.acquire()
        try:
            sock = self._open(deadline, liveness)
        except _Silent as exc:
            self.silent = True
            self._lock.release()
            err = f"UNAVAILABLE: {exc}"
            return lambda: (None, err)
        except BaseException:
            self._lock.release()
            raise
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(frame(NUMBER_OF[method], request.SerializeToString()))
        except OSError as exc:  # a failed send: the rollout cannot have read the whole request
            self._drop()
            self._lock.release()
            raise LinkDown(f"sync link to {self.address}: send failed: {exc}") from None
        except BaseException:
            self._drop()  # part of a frame may be out: the next request must go on a fresh link
            self._lock.release()
            raise
        read = []

        def answer() -> tuple:
            if read:
                raise RuntimeError(f"sync link to {self.address}: the answer to {method} was already read")
            read.append(True)
            try:
                return self._answer_of(sock, method, response_type, timeout, deadline, liveness)
            finally:
                self._lock.release()

        return answer

    def _answer_of(self, sock: socket.socket, method: str, response_type, timeout: float, deadline: float, liveness):
        """The answer to the request just sent on `sock` (under the link's lock), as `call` returns it."""
        try:
            status, payload = self._answer(sock, deadline, liveness)
        except TimeoutError:
            self._drop()  # its answer may still come: the next request must not read it
            if time.monotonic() < deadline - 0.01:  # silent before the deadline: the liveness gave up
                self.silent = True
                return None, (
                    f"UNAVAILABLE: sync link to {self.address}: {method}: the rollout went silent (no answer "
                    f"nor liveness beat for {liveness:.1f}s; liveness_timeout_s): stopped, hung or unreachable"
                )
            return None, f"DEADLINE_EXCEEDED: sync link to {self.address}: {method} not answered in {timeout:.1f}s"
        except (OSError, TransportError) as exc:
            self._drop()
            return None, f"UNAVAILABLE: sync link to {self.address}: {method}: {exc}"
        except BaseException:
            self._drop()  # an answer left half read: the next request must not read the rest
            raise
        self.silent = False
        if status:
            return None, f"{status_code(status).name}: {payload.decode('utf-8', errors='replace')}"
        try:
            return response_type.FromString(payload), ""
        except Exception as exc:  # protobuf DecodeError
            return None, f"INTERNAL: sync link to {self.address}: {method}: unreadable answer ({exc})"

    def open(self, timeout: float, liveness: float | None = None) -> bool:
        """Open the link now, if it is not open (and not waiting out a failed try): whether it is open.

        A sync opens it right after the PrepareSync that named it, so that its first stream is watched
        too (`ping`); a link that cannot be opened says why in the log and is tried again by the next call."""
        with self._lock:
            if self._sock is not None:
                return True
            if not self.usable():
                return False
            try:
                self._open(time.monotonic() + timeout, liveness)
            except (LinkDown, _Silent) as exc:
                log.warning("%s; this sync's calls to it go over gRPC", exc)
                return False
            return True

    def ping(self) -> bool:
        """Ask the rollout for a BEAT between calls, and read the ones it already answered (`last_heard`).

        Never blocks. True when the rollout's silence from now on means something: a PING went out, or
        could not because the rollout is not reading its link (its send buffer is full: no answer will
        come), or a call is in flight (its own beats say the same). False when there is no link to ask
        (never opened, or found closed or broken): nothing can answer, so no silence may be judged."""
        if not self._lock.acquire(blocking=False):
            return True
        try:
            sock = self._sock
            if sock is None:
                return False
            heard, usable = _drain(sock)
            if heard:
                self.last_heard = time.monotonic()
            if not usable:
                return False  # the next call reopens it
            # a socket with a timeout waits for room before a send, MSG_DONTWAIT or not: ask first
            if not _ready(sock, select.POLLOUT):
                return True  # a full buffer: the rollout is not reading its link, no answer will come
            try:
                sock.send(_PING, socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError included: as a full buffer
                pass
            return True
        finally:
            self._lock.release()

    def _answer(self, sock: socket.socket, deadline: float, liveness: float | None) -> tuple[int, bytes]:
        """The answer frame, past any beats; TimeoutError at `deadline` or after `liveness` s of silence."""
        while True:
            until = deadline if liveness is None else min(deadline, time.monotonic() + liveness)
            status, payload = read_frame(sock, until)
            self.last_heard = time.monotonic()
            if status != BEAT:
                return status, payload

    def _open(self, deadline: float, liveness: float | None = None) -> socket.socket:
        if self._sock is not None:
            heard, usable = _drain(self._sock)  # answers to the stream's pings
            if heard:
                self.last_heard = time.monotonic()
            if not usable:
                self._drop()  # the rollout restarted or dropped the link since the last sync: open another
        if self._sock is not None:
            return self._sock
        try:
            self._sock = self._connect(deadline, liveness)
        except _Silent as exc:
            if liveness is None:
                self.retry_at = time.monotonic() + RETRY_AFTER_S
                raise LinkDown(str(exc)) from None
            # gRPC to a process that accepts connections but never answers would hang for the whole
            # call: the caller fails this call instead, and the link is tried again on the next one
            raise
        except ConnectionRefusedError:
            self.retry_at = time.monotonic() + RETRY_REFUSED_S
            raise LinkDown(
                f"sync link to {self.address} could not be opened: connection refused (the rollout is down or "
                "restarting, or offers no link on this port)"
            ) from None
        except (OSError, TimeoutError) as exc:
            self.retry_at = time.monotonic() + RETRY_AFTER_S
            raise LinkDown(
                f"sync link to {self.address} could not be opened: connect failed or timed out ({exc}; "
                "a firewall or an unreachable host?)"
            ) from None
        except _Rejected as exc:
            self.retry_at = time.monotonic() + RETRY_AFTER_S
            raise LinkDown(f"sync link to {self.address} could not be opened: handshake rejected: {exc}") from None
        return self._sock

    def _connect(self, deadline: float, liveness: float | None = None) -> socket.socket:
        sock = socket.create_connection(
            (self.host, self.port), timeout=max(0.001, min(_CONNECT_TIMEOUT_S, deadline - time.monotonic()))
        )
        hello_s = _CONNECT_TIMEOUT_S if liveness is None else min(_CONNECT_TIMEOUT_S, liveness)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(LINK_MAGIC_BEATS)
            hello_deadline = time.monotonic() + hello_s
            nonce = recv_exact(sock, NONCE_BYTES, hello_deadline)
            sock.sendall(link_mac(self.token, nonce))
            if recv_exact(sock, 1, hello_deadline) != ACCEPTED:
                raise _Rejected("the rollout answered the handshake with a refusal")
            self.last_heard = time.monotonic()
        except TimeoutError:
            sock.close()
            raise _Silent(
                f"sync link to {self.address}: connected, but the rollout did not answer the handshake in "
                f"{hello_s:.1f}s: stopped, hung or overloaded"
            ) from None
        except (TransportError, ConnectionResetError) as exc:
            sock.close()
            raise _Rejected(
                f"{exc} (a wrong token, no link offered on this port, or the rollout's link slots / "
                "pre-auth budget full: see its log)"
            ) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
