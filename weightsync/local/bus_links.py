"""Emulated sender links for local tests and benchmarks of the TCP weight bus.

On one machine every trainer rank shares loopback, so "each sender has its own NIC" cannot be seen
directly. `LinkProxy` sits in front of a rollout's data port (the rollout advertises the proxy's
host, see rollout `advertise_data_host`); it reads each connection's hello to learn which trainer
rank is sending and paces the bytes through that rank's `SenderLinks` budget, shared by every proxy:
each sender rank gets `rate` bytes/s across all the rollouts it streams to, like one NIC per rank.
It can also cut one sender's connections after some bytes, or call a hook when a sender has moved
a given amount (to kill a process mid-stream).
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

_CHUNK = 16 << 10


def close_sockets(socks, shutdown: bool = False) -> None:
    """Close each socket (shut down both directions first: the peer sees EOF at once), ignoring
    ones already gone. Shared by the test proxies in front of a data port."""
    for s in socks:
        try:
            if shutdown:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass


class SenderLinks:
    """Per-sender-rank byte budgets (token-bucket pacing) and counters, shared by every proxy."""

    def __init__(self, rate_bytes_per_s: float | None):
        self.rate = rate_bytes_per_s   # None: unpaced
        self.sent: dict[int, int] = {}
        self.cut_after: dict[int, int] = {}  # sender -> close its connections past this many bytes
        self.hooks: list[tuple[int, int, Callable[[], None]]] = []  # (sender, after bytes, fn), fired once
        self._free_at: dict[int, float] = {}
        self._lock = threading.Lock()

    def reset(self, rate_bytes_per_s: float | None = None) -> None:
        with self._lock:
            self.rate = rate_bytes_per_s
            self.sent.clear(), self.cut_after.clear(), self.hooks.clear(), self._free_at.clear()

    def take(self, sender: int, n: int) -> bool:
        """Account `n` bytes of `sender` (sleeping to keep its rate); False: cut the connection."""
        with self._lock:
            done = self.sent.get(sender, 0)
            if sender in self.cut_after and done + n > self.cut_after[sender]:
                return False
            self.sent[sender] = done + n
            fire = [h for h in self.hooks if h[0] == sender and done + n >= h[1]]
            for h in fire:
                self.hooks.remove(h)
            wait = 0.0
            if self.rate:
                now = time.monotonic()
                start = max(now, self._free_at.get(sender, now))
                self._free_at[sender] = start + n / self.rate
                wait = self._free_at[sender] - now
        for _, _, fn in fire:
            fn()
        if wait > 0:
            time.sleep(wait)
        return True


def _read_hello(sock: socket.socket) -> tuple[bytes, int]:
    """The raw hello frame (forwarded unchanged) and the sender rank it names (wire.py's layout)."""
    head = _recv_n(sock, 6)
    (n,) = struct.unpack("<H", head[4:6])
    rest = _recv_n(sock, n + 4 + 32)
    (sender,) = struct.unpack("<I", rest[n:n + 4])
    return head + rest, sender


def _recv_n(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise OSError("peer closed during the hello")
        buf += part
    return buf


class LinkProxy:
    """Forwards listen_host:port -> target, pacing trainer->rollout bytes by sender rank."""

    def __init__(self, listen_host: str, listen_port: int, target: tuple[str, int], links: SenderLinks):
        self.target, self.links = target, links
        self.connections: list[int] = []  # sender rank of each connection, in accept order
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # a small receive window (inherited by accepted sockets): the proxy, not the kernel, holds
        # back a paced sender, so a sender killed "mid-stream" has really not sent the rest yet
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
        self.sock.bind((listen_host, listen_port))
        self.sock.listen(16)
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True, name="link-conn").start()

    def _serve(self, c: socket.socket) -> None:
        try:
            c.settimeout(30)
            hello, sender = _read_hello(c)
            c.settimeout(None)
            u = socket.create_connection(self.target, timeout=10)
            u.settimeout(None)
        except OSError:
            c.close()
            return
        self.connections.append(sender)
        self._socks += [c, u]
        u.sendall(hello)
        threading.Thread(target=self._pump, args=(u, c, None), daemon=True).start()
        self._pump(c, u, sender)

    def _pump(self, src: socket.socket, dst: socket.socket, sender: int | None) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                if sender is not None and not self.links.take(sender, len(data)):
                    break
                dst.sendall(data)
        except OSError:
            pass
        close_sockets((src, dst), shutdown=True)

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        close_sockets(self._socks)
