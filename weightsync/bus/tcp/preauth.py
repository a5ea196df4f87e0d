"""Pre-auth admission for the rollout's data port: a flood cannot lock out a client that authenticates promptly.

A connection that has not proved the token yet waits in this budget (`total` in all, `per_address`
from one peer address). Refusing the newest connection when the budget is full lets anyone who can
open connections from the trainer's own address (a shared node, hostNetwork, a NAT or egress gateway)
keep the trainer out for as long as they keep their connections open or reconnect when dropped. So a
new connection is always admitted; when that puts its address (or the whole budget) over its cap,
an older waiting connection is evicted (its socket shut down) instead:

- the victim is the oldest connection that is *not making progress*: progress is counted in
  handshake stages, not bytes. A connection's current stage needs a known number of bytes (a
  magic, a length, the rest of a hello, a MAC); a connection whose kernel buffer already holds
  them is about to move on and is spared, so a trickled byte buys a peer nothing;
- only when every candidate is making progress is the oldest of them evicted (each one is
  about to be decided anyway).

A prompt client (the trainer writes its whole hello right after connecting) is making progress from
the moment its bytes arrive, so a flood that only connects, idles or trickles evicts its own
connections, never that client's. The cap per address then bounds what one address holds, not who
gets in.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
import threading
import time

log = logging.getLogger(__name__)

_LOG_PERIOD_S = 10.0


def buffered(conn: socket.socket) -> int:
    """Bytes the kernel holds unread for `conn` (0 once it is closed): never blocks, reads nothing."""
    try:
        fd = conn.fileno()
        if fd < 0:
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class Ticket:
    """One waiting connection: its address, the stage it is in and the bytes that stage needs."""

    __slots__ = ("conn", "address", "since", "needs", "evicted", "_in")

    def __init__(self, conn: socket.socket, address: str, needs: int):
        self.conn, self.address, self.needs = conn, address, needs
        self.since = time.monotonic()
        self.evicted = False
        self._in = True


class PreAuthBudget:
    """Connections not yet authenticated: at most `total`, at most `per_address` from one address;
    over a cap the oldest connection not making progress is evicted, never the newest refused."""

    def __init__(self, total: int, per_address: int, what: str = "connection"):
        if total < 1 or per_address < 1:
            raise ValueError(f"pre-auth budget needs total >= 1 and per_address >= 1 (got {total}, {per_address})")
        self.total, self.per_address, self.what = total, per_address, what
        self._lock = threading.Lock()
        self._waiting: list[Ticket] = []  # in order of arrival
        #: connections evicted since start (each made room for a newer one)
        self.evictions = 0
        self._next_log = 0.0

    def enter(self, conn: socket.socket, address: str, needs: int) -> Ticket:
        """Admit `conn`, whose first stage needs `needs` bytes; evicts another connection if over a cap."""
        ticket = Ticket(conn, address, needs)
        with self._lock:
            self._waiting.append(ticket)
            same = [t for t in self._waiting if t.address == address]
            if len(same) > self.per_address:
                self._evict_one(same[:-1])
            if len(self._waiting) > self.total:
                self._evict_one(self._crowded_address_tickets(exclude=ticket))
        return ticket

    def progress(self, ticket: Ticket, needs: int) -> None:
        """`ticket` finished a stage; the next one needs `needs` bytes (its clock starts again)."""
        with self._lock:
            ticket.needs, ticket.since = needs, time.monotonic()

    def leave(self, ticket: Ticket) -> None:
        """The connection authenticated or failed (idempotent; an evicted one has already left)."""
        with self._lock:
            if ticket._in:
                ticket._in = False
                self._waiting.remove(ticket)

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def _crowded_address_tickets(self, exclude: Ticket) -> list[Ticket]:
        counts: dict[str, int] = {}
        for t in self._waiting:
            counts[t.address] = counts.get(t.address, 0) + 1
        crowded = max(counts, key=lambda a: counts[a])
        return [t for t in self._waiting if t.address == crowded and t is not exclude]

    def _evict_one(self, candidates: list[Ticket]) -> None:
        if not candidates:
            return
        stalled = [t for t in candidates if buffered(t.conn) < t.needs]
        victim = min(stalled or candidates, key=lambda t: t.since)
        victim._in, victim.evicted = False, True
        self._waiting.remove(victim)
        self.evictions += 1
        now = time.monotonic()
        if now >= self._next_log:  # a flood evicts thousands a second: one line per period says it
            self._next_log = now + _LOG_PERIOD_S
            log.warning(
                "%s from %s evicted before it authenticated (%.1f s in its handshake stage without progress) to "
                "admit a newer one: %d waiting, at most %d from one address; %d evicted since start",
                self.what,
                victim.address,
                now - victim.since,
                len(self._waiting),
                self.per_address,
                self.evictions,
            )
        try:
            victim.conn.shutdown(socket.SHUT_RDWR)  # wakes its handshake thread, which closes it
        except OSError:
            pass
