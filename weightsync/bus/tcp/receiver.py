"""The rollout's end of TCP: a listener that authenticates the trainer's connection and feeds the pending sync.

Nothing is allocated for a connection before its hello proves the token and names the sync
prepared here: the hello is at most 294 bytes, and a bucket buffer is sized from the accepted
manifest at the first matching frame header. At most `max_connections` connections are handled at
once (one thread each); extra ones are closed at accept. A connection that opens with another
protocol's magic instead of a hello is handed to that protocol (`other_protocols`: the rollout's
sync link), which then holds none of these slots.
"""
from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections.abc import Callable

from weightsync.bus.errors import SyncError
from weightsync.bus.rollout_end import RolloutEnd
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
            raise SyncError(f"manifest.buckets name {len(manifest.senders)} senders; this rollout accepts "
                            f"max_bus_connections={self.max_connections} bus connections: raise "
                            "limits.max_bus_connections to at least the trainer's sender count, or sync with "
                            "senders=rank0", "INVALID_ARGUMENT")
        resp.transport.tcp.data_address = self.data_address


class TcpReceiver:
    def __init__(self, address: str, transaction, token: str, hello_timeout: float = 10.0, max_connections: int = 8):
        host, port = parse_host_port("data_address", address)
        self.tx = transaction
        self.token = token
        self.hello_timeout = hello_timeout
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
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
            if not self._slots.acquire(blocking=False):
                log.warning("bus connection from %s refused: %d connections already open (max_bus_connections)",
                            peer, self.max_connections)
                conn.close()
                continue
            threading.Thread(target=self._handle_slot, args=(conn, peer), name="bus-recv", daemon=True).start()

    def _handle_slot(self, conn: socket.socket, peer) -> None:
        released = False
        try:
            try:
                conn.settimeout(self.hello_timeout)
                magic = recv_magic(conn)
            except Exception as exc:
                log.warning("bus connection from %s rejected: %s", peer, exc)
                conn.close()
                return
            serve = self.other_protocols.get(magic)
            if serve is None:
                self._handle(conn, peer, magic)
                return
            # a long-lived connection of another protocol holds none of the bus's slots
            self._slots.release()
            released = True
            serve(conn, peer)
        finally:
            if not released:
                self._slots.release()

    def _handle(self, conn: socket.socket, peer, magic: bytes) -> None:
        try:
            sync_id, sender, mac = read_hello(conn, self.hello_timeout, magic)
        except Exception as exc:
            log.warning("bus connection from %s rejected: %s", peer, exc)
            conn.close()
            return
        if not hmac.compare_digest(mac, hello_mac(self.token, sync_id, sender)):
            log.warning("bus connection from %s rejected: bad token for sync %s (sender %d)", peer, sync_id, sender)
            conn.close()
            return
        if self.tx.pending_manifest(sync_id) is None:
            log.warning("bus connection from %s for sync %s, which is not prepared here", peer, sync_id)
            conn.close()
            return
        self.tx.run_receiver(sync_id, TcpBucketReceiver(conn), sender)

    def stop(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass
