"""Issue 49: unauthenticated connections from the trainer's own address cannot lock real syncs out.

8 peers trickle a hello and 8 sit idle, all from 127.0.0.1 like the trainer, each reconnecting as soon
as the rollout drops it. Before, the per-address cap refused the trainer's own bus connection
("Connection reset by peer") for as long as the attack lasted; now the newest connection is always
admitted and the oldest one making no progress is evicted, so the trainer (whose hello is in the
rollout's kernel buffer the moment it connects) gets in and every sync commits exactly.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.unit.rollout_svc.test_hardening import _rollout, _trainer
from weightsync.bus.tcp.preauth import PreAuthBudget
from weightsync.control.client import channel, trainer_stub


class _Attacker:
    """One unauthenticated peer from 127.0.0.1 that reconnects 20 ms after each drop: it either sends a
    hello's first bytes one at a time (`trickle`) or nothing at all."""

    def __init__(self, address, trickle: float | None):
        from weightsync.bus.tcp.wire import hello_frame

        self.address, self.trickle = address, trickle
        self.payload = hello_frame("v1-attack", 0, b"\0" * 32)
        self.connects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                with socket.create_connection(self.address, timeout=5) as sock:
                    self.connects += 1
                    self._hold(sock)
            except OSError:
                pass
            self._stop.wait(0.02)

    def _hold(self, sock: socket.socket) -> None:
        sent = 0
        while not self._stop.is_set():
            if self.trickle is not None and sent < len(self.payload):
                sock.send(self.payload[sent : sent + 1])
                sent += 1
            sock.settimeout(self.trickle or 0.5)
            try:
                if sock.recv(1) == b"":
                    return  # dropped by the rollout: reconnect
            except socket.timeout:
                continue

    def stop(self):
        self._stop.set()
        self._thread.join(5)


def test_flood_from_the_trainers_address_leaves_real_syncs_committing():
    from tests.support.fleet_sync import bump_and_sync_exactly

    trainer = _trainer()
    app = _rollout(trainer_address=trainer.grpc.address, rollout_id="r-flood")
    attackers = []
    try:
        deadline = time.monotonic() + 30
        while "r-flood" not in [e.rollout_id for e in trainer.registry.all()] and time.monotonic() < deadline:
            time.sleep(0.05)
        port = (app.data.host, app.data.port)
        attackers = [_Attacker(port, trickle=0.5) for _ in range(8)] + [_Attacker(port, trickle=None) for _ in range(8)]
        deadline = time.monotonic() + 10
        while app.data.handshakes.waiting() < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.data.handshakes.waiting() == 8  # the address's whole pre-auth budget is held by the flood
        stub = trainer_stub(channel(trainer.grpc.address), "", 60)
        for _ in range(3):
            bump_and_sync_exactly(trainer, {"r-flood": app}, stub)
        assert app.data.handshakes.waiting() <= 8
        assert sum(a.connects for a in attackers) > 16  # dropped and back: the flood lasted through the syncs
    finally:
        for a in attackers:
            a.stop()
        app.stop()
        trainer.stop()


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    return a, b


def test_budget_evicts_the_oldest_stalled_connection_not_one_making_progress():
    budget = PreAuthBudget(total=64, per_address=2)
    socks = [_pair() for _ in range(4)]
    try:
        stalled = budget.enter(socks[0][0], "10.0.0.1", needs=4)
        ready = budget.enter(socks[1][0], "10.0.0.1", needs=4)
        socks[1][1].sendall(b"WSH2")  # its whole stage is buffered: progress
        socks[0][1].sendall(b"W")  # a trickled byte is not
        time.sleep(0.01)
        newest = budget.enter(socks[2][0], "10.0.0.1", needs=4)  # over the per-address cap
        assert stalled.evicted and not ready.evicted and not newest.evicted
        assert socks[0][1].recv(1) == b""  # its socket was shut down
        assert budget.waiting() == 2 and budget.evictions == 1
        # another address is untouched by this one's cap
        other = budget.enter(socks[3][0], "10.0.0.2", needs=4)
        assert not other.evicted and budget.waiting() == 3
        for t in (stalled, ready, newest, other):  # idempotent, also for the evicted one
            budget.leave(t)
        assert budget.waiting() == 0
    finally:
        for a, b in socks:
            a.close()
            b.close()


def test_a_full_total_evicts_from_the_most_crowded_address():
    budget = PreAuthBudget(total=3, per_address=3)
    socks = [_pair() for _ in range(4)]
    try:
        t = [budget.enter(socks[i][0], addr, needs=4) for i, addr in enumerate(["a", "b", "b"])]
        t.append(budget.enter(socks[3][0], "c", needs=4))
        assert [x.evicted for x in t] == [False, True, False, False]
    finally:
        for a, b in socks:
            a.close()
            b.close()


@pytest.mark.parametrize("total,per_address", [(0, 1), (1, 0)])
def test_budget_limits_must_be_positive(total, per_address):
    with pytest.raises(ValueError, match="per_address >= 1"):
        PreAuthBudget(total, per_address)
