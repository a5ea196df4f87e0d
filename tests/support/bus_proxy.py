"""A TCP proxy in front of a rollout's data port, with pluggable link policies (tests and benchmarks).

The rollout listens on 127.0.0.1 and advertises the proxy's host (rollout `advertise_data_host`),
so every connection the trainer opens to its data port passes here. The proxy reads each
connection's first bytes to tell the protocols apart and counts connections by protocol: a weight
bus connection (the bus hello, weightsync.bus.tcp.wire) names the trainer rank that sends on it;
the sync link (weightsync.control.sync_link) shares the port and always passes unshaped.

The trainer→rollout bytes of every bus connection go through a policy: any object with
`take(sender, nbytes) -> FORWARD | CUT | STALL`, which may block to pace the link. `SenderLinks`
is the one these tests use; one instance can be shared by several proxies, so a trainer rank's
budget spans all the rollouts it streams to, like one NIC per rank. It can
- pace each sender to `rate` bytes/s (a slow link: a fault lands mid-stream however fast the box is),
- cut a sender's connections past some bytes (the peer sees EOF at once),
- stall them past some bytes (forward nothing more, hold both sockets open: a hung network),
- call a hook when a sender has moved some bytes (to kill a process mid-stream),
- flip one byte past some bytes (corruption in flight, which the rollout's checksums catch).
Tests shape the link this way instead of sleeping and hoping that a sync is still streaming.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

from weightsync.bus.tcp.wire import HELLO_MAGIC
from weightsync.control.sync_link import LINK_MAGIC, LINK_MAGIC_BEATS

FORWARD, CUT, STALL = "forward", "cut", "stall"
#: a rule keyed by ANY applies to the bytes of all senders together (a single-sender proxy's link)
ANY = -1
_CHUNK = 64 << 10
_PROTOCOLS = {HELLO_MAGIC: "bus", LINK_MAGIC: "link", LINK_MAGIC_BEATS: "link"}


def close_sockets(socks, shutdown: bool = False) -> None:
    """Close each socket (shut down both directions first: the peer sees EOF at once), ignoring
    ones already gone."""
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
    """Per-sender-rank byte counters, token-bucket pacing, cuts, stalls and hooks: a proxy's policy.

    `cut_after` / `stall_after` map a sender rank (or ANY, counted over all senders) to the bytes
    after which its connections are cut / stalled; the chunk that crosses the limit is not forwarded.
    `hooks` are (sender, after bytes, fn), each fired once. Set them directly, or with `set`.
    """

    def __init__(self, rate_bytes_per_s: float | None = None):
        self.rate = rate_bytes_per_s  # None: unpaced
        self.sent: dict[int, int] = {}  # sender -> bytes forwarded (ANY: all senders)
        self.cut_after: dict[int, int] = {}
        self.stall_after: dict[int, int] = {}
        self.hooks: list[tuple[int, int, Callable[[], None]]] = []
        #: the offset (over all senders' bytes, from the last set) of the one byte to flip; None: none
        self.flip_at: int | None = None
        self._seen = 0
        self._free_at: dict[int, float] = {}
        self._lock = threading.Lock()

    def reset(self, rate_bytes_per_s: float | None = None) -> None:
        """Forget counters and rules; pace at `rate_bytes_per_s` from now on (None: unpaced)."""
        with self._lock:
            self.rate = rate_bytes_per_s
            for d in (self.sent, self.cut_after, self.stall_after, self._free_at):
                d.clear()
            self.hooks.clear()
            self.flip_at, self._seen = None, 0

    def set(self, mode: str, after_bytes: int = 0, rate: float = 0.0) -> None:
        """One rule for every sender, counting from now: pass | cut | stall (past `after_bytes`) |
        flip (the byte at `after_bytes`, once) | slow (pace each sender at `rate` bytes/s)."""
        if mode not in ("pass", "cut", "stall", "flip", "slow"):
            raise ValueError(f"mode {mode!r}: must be pass, cut, stall, flip or slow")
        if mode == "slow" and rate <= 0:
            raise ValueError("slow mode needs rate > 0 (bytes/s)")
        self.reset(rate if mode == "slow" else None)
        if mode == "cut":
            self.cut_after[ANY] = after_bytes
        elif mode == "stall":
            self.stall_after[ANY] = after_bytes
        elif mode == "flip":
            self.flip_at = after_bytes

    def corrupt(self, data: bytes) -> bytes:
        """`data` (the next bytes of any sender), with the byte at `flip_at` inverted if it falls in them."""
        with self._lock:
            start, self._seen = self._seen, self._seen + len(data)
            if self.flip_at is None or not start <= self.flip_at < self._seen:
                return data
            k, self.flip_at = self.flip_at - start, None
        return data[:k] + bytes([data[k] ^ 0xFF]) + data[k + 1 :]

    def take(self, sender: int, n: int) -> str:
        """Account `n` bytes of `sender` (sleeping to keep its rate) and say what becomes of them."""
        with self._lock:
            done = {k: self.sent.get(k, 0) + n for k in (sender, ANY)}
            for limits, verdict in ((self.cut_after, CUT), (self.stall_after, STALL)):
                if any(k in limits and done[k] > limits[k] for k in (sender, ANY)):
                    return verdict
            self.sent.update(done)
            fire = [h for h in self.hooks if h[0] == sender and done[sender] >= h[1]]
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
        return FORWARD


def _recv_n(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise OSError(f"peer closed after {len(buf)} of the {n} bytes expected")
        buf += part
    return buf


def _rest_of_hello(sock: socket.socket) -> tuple[bytes, int]:
    """The bus hello after its magic (forwarded unchanged) and the sender rank it names (wire.py's layout)."""
    head = _recv_n(sock, 2)
    (n,) = struct.unpack("<H", head)
    rest = _recv_n(sock, n + 4 + 32)
    (sender,) = struct.unpack("<I", rest[n : n + 4])
    return head + rest, sender


class BusProxy:
    """Forwards listen_host:port -> target, shaping the trainer→rollout bytes of bus connections
    through `links` (its own SenderLinks unless given one to share).

    `connections`: the sender rank of each bus connection, in accept order; `protocols`: how many
    connections of each protocol ("bus", "link", "other") were forwarded. A connection the target
    refuses (the rollout is down) is closed, as a real proxy does."""

    def __init__(self, listen_host: str, listen_port: int, target: tuple[str, int], links: SenderLinks | None = None):
        self.target = target
        self.links = links if links is not None else SenderLinks()
        self.connections: list[int] = []
        self.protocols: Counter[str] = Counter()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # a small receive window (inherited by accepted sockets): the proxy, not the kernel, holds
        # back a paced sender, so a sender killed "mid-stream" has really not sent the rest yet
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
        self.sock.bind((listen_host, listen_port))
        self.sock.listen(16)
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()  # connections are opened on threads of their own
        threading.Thread(target=self._accept, daemon=True, name="bus-proxy-accept").start()

    def set(self, mode: str, after_bytes: int = 0, rate: float = 0.0) -> None:
        """Shortcut for this proxy's links: see SenderLinks.set."""
        self.links.set(mode, after_bytes, rate)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._open, args=(c,), daemon=True, name="bus-proxy-conn").start()

    def _open(self, c: socket.socket) -> None:
        try:
            c.settimeout(30)
            first = _recv_n(c, 4)
            protocol = _PROTOCOLS.get(first, "other")
            sender = None
            if protocol == "bus":
                rest, sender = _rest_of_hello(c)
                first += rest
            c.settimeout(None)
            u = socket.create_connection(self.target, timeout=10)
            u.settimeout(None)
            u.sendall(first)
        except OSError:
            close_sockets((c,), shutdown=True)
            return
        with self._lock:
            self.protocols[protocol] += 1
            if sender is not None:
                self.connections.append(sender)
            self._socks += [c, u]
        threading.Thread(target=self._pump, args=(u, c, None), daemon=True, name="bus-proxy-back").start()
        self._pump(c, u, sender)

    def _pump(self, src: socket.socket, dst: socket.socket, sender: int | None) -> None:
        """Forward src -> dst; `sender`: a bus connection's trainer→rollout side, which the links shape."""
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                verdict = FORWARD if sender is None else self.links.take(sender, len(data))
                if verdict == CUT:
                    break
                if verdict == STALL:
                    self._closed.wait()  # hold both sockets open, forward nothing more
                    return
                dst.sendall(data if sender is None else self.links.corrupt(data))
        except OSError:
            pass
        close_sockets((src, dst), shutdown=True)

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        close_sockets(self._socks)
