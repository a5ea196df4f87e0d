"""The rollout's end of TCP: a listener that authenticates the trainer's connection and feeds the pending sync.

Before its hello proves the token, a connection costs almost nothing and holds nothing a trainer
needs: it waits in a *handshake* budget of its own (`max_handshakes` in all, at most
`max_handshakes_per_address` from one address; over a cap the oldest connection that makes no
progress is evicted, not the newest refused: weightsync.bus.tcp.preauth), and its magic and hello
(at most 294 bytes) must arrive within `hello_timeout` seconds in total, however the peer spaces
its bytes. Only an authenticated connection for the sync prepared here takes one of the
`max_connections` stream slots (one thread each), and a bucket buffer is sized from the accepted
manifest at its first frame header. A connection that opens with another protocol's magic is
handed to that protocol (`other_protocols`: the rollout's sync link), which bounds its own.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable

from weightsync.bus.errors import SyncError
from weightsync.bus.rollout_end import RolloutEnd
from weightsync.bus.tcp.preauth import PreAuthBudget
from weightsync.bus.tcp.wire import TcpBucketReceiver, hello_mac, read_hello, recv_magic
from weightsync.config import parse_host_port

log = logging.getLogger(__name__)


class TcpRolloutEnd(RolloutEnd):
    """TCP's part in PrepareSync: the answer names the data port, whose listener (TcpReceiver,
    run beside the gRPC server) feeds the prepared sync by itself."""

    name = "tcp"

    def __init__(self, data_address: str, max_connections: int):
        self.data_address, self.max_connections = data_address, max_connections

    @classmethod
    def for_rollout(cls, side) -> "TcpRolloutEnd":
        return cls(side.data_address, side.max_connections)

    def prepare(self, spec, manifest, resp) -> None:
        if len(manifest.senders) > self.max_connections:
            # one bus connection per sender: the extra ones would be closed and the sync time out
            raise SyncError(
                f"manifest.buckets name {len(manifest.senders)} senders; this rollout accepts "
                f"max_bus_connections={self.max_connections} bus connections: raise "
                "limits.max_bus_connections to at least the trainer's sender count, or sync with "
                "senders=rank0",
                "INVALID_ARGUMENT",
            )
        resp.transport.tcp.data_address = self.data_address


class TcpReceiver:
    def __init__(
        self,
        address: str,
        transaction,
        token: str,
        hello_timeout: float = 10.0,
        max_connections: int = 8,
        max_handshakes: int = 64,
        max_handshakes_per_address: int = 8,
        delta_base=None,
    ):
        """`delta_base`: the rollout's copy of its committed buckets, onto which delta buckets apply
        (rollout_svc/sync/delta_base.py); None: delta frames are refused."""
        host, port = parse_host_port("data_address", address)
        self.tx = transaction
        self.delta_base = delta_base
        self.token = token
        self.hello_timeout = hello_timeout
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.handshakes = PreAuthBudget(max_handshakes, max_handshakes_per_address, "bus connection")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        # A restarted rollout binds its data port again while the connections its predecessor closed
        # are still in TIME_WAIT on it (a minute on Linux); an active listener still refuses the bind.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise RuntimeError(f"cannot listen on data_address {address}: {exc.strerror} (pick another port)") from None
        self.sock.listen(16)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="bus-accept", daemon=True)
        self._closed = False
        #: 4-byte magic -> serve(conn, peer): other protocols on this port (the rollout's sync link)
        self.other_protocols: dict[bytes, Callable[[socket.socket, object], None]] = {}

    def start(self) -> None:
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            ticket = self.handshakes.enter(conn, address, needs=4)  # first stage: the magic
            threading.Thread(target=self._handshake, args=(conn, peer, ticket), name="bus-hello", daemon=True).start()

    def _handshake(self, conn: socket.socket, peer, ticket) -> None:
        """Read the first bytes under the handshake budget, then hand the connection on."""
        deadline = time.monotonic() + self.hello_timeout
        try:
            magic = recv_magic(conn, deadline)
            serve = self.other_protocols.get(magic)
            stage = lambda n: self.handshakes.progress(ticket, n)  # noqa: E731
            hello = None if serve is not None else read_hello(conn, deadline, magic, stage)
        except Exception as exc:
            self.handshakes.leave(ticket)
            if ticket.evicted:  # the budget logged it (rate-limited: a flood evicts many)
                log.debug("bus connection from %s evicted: %s", peer, exc)
            else:
                log.warning("bus connection from %s rejected: %s", peer, exc)
            conn.close()
            return
        self.handshakes.leave(ticket)
        if serve is not None:
            serve(conn, peer)
        else:
            self._stream(conn, peer, *hello)

    def _stream(self, conn: socket.socket, peer, sync_id: str, sender: int, mac: bytes) -> None:
        if not hmac.compare_digest(mac, hello_mac(self.token, sync_id, sender)):
            log.warning("bus connection from %s rejected: bad token for sync %s (sender %d)", peer, sync_id, sender)
            conn.close()
            return
        if self.tx.pending_manifest(sync_id) is None:
            log.warning("bus connection from %s for sync %s, which is not prepared here", peer, sync_id)
            conn.close()
            return
        if not self._slots.acquire(blocking=False):
            log.warning(
                "bus connection from %s for sync %s refused: %d streams already open (max_bus_connections)",
                peer,
                sync_id,
                self.max_connections,
            )
            conn.close()
            return
        try:
            base = self.delta_base and self.delta_base.for_sync(sync_id)
            self.tx.run_receiver(sync_id, TcpBucketReceiver(conn, base), sender)
        finally:
            self._slots.release()

    def stop(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass
