"""The engine gate for an engine that batches requests itself (`pinned(takes_turns=False)`, SGLang).

Pinned requests run at once (none waits for a turn), while the version-pin guarantees stay those of the
built-in engine's gate: a sync waits until no request holds a pin, and no pin is granted while it waits.
Nothing is timed: each request blocks on an Event the test sets.
"""

from __future__ import annotations

import threading

import pytest

from rollout_svc.sync.engine_gate import EngineGate, GateError, SharedTurn

WAIT_S = 10.0  # the longest a step of a test waits (a failing test, not a slow one)


class _Request:
    """A pinned request on its own thread, running until `finish` is set; `inside` once it holds its pin."""

    def __init__(self, gate: EngineGate, takes_turns: bool = False, is_active=lambda: True, timeout: float = WAIT_S):
        self.inside, self.finish, self.done = threading.Event(), threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.turn = None

        def run():
            try:
                with gate.pinned(timeout, is_active, takes_turns=takes_turns) as turn:
                    self.turn = turn
                    self.inside.set()
                    assert self.finish.wait(WAIT_S)
                    turn()  # a step: a SharedTurn hands nothing over, it checks the client only
            except BaseException as exc:  # noqa: BLE001 — the test reads it
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()


def test_pinned_requests_run_at_once_without_turns():
    gate = EngineGate()
    a = _Request(gate)
    assert a.inside.wait(WAIT_S) and isinstance(a.turn, SharedTurn)
    b = _Request(gate)  # A still runs: B gets its pin all the same and runs to its end
    assert b.inside.wait(WAIT_S) and gate.pins == 2
    b.finish.set()
    assert b.done.wait(WAIT_S) and b.error is None
    assert not a.done.is_set() and gate.pins == 1
    a.finish.set()
    assert a.done.wait(WAIT_S) and a.error is None and gate.idle


def test_turn_taking_requests_still_wait_for_the_holder():
    """The built-in engine's gate is unchanged: with turns, B gets none while A holds the first and never yields."""
    gate = EngineGate()
    a = _Request(gate, takes_turns=True)
    assert a.inside.wait(WAIT_S)
    b = _Request(gate, takes_turns=True, timeout=0.3)
    assert b.done.wait(WAIT_S) and isinstance(b.error, GateError) and b.error.code == "UNAVAILABLE"
    a.finish.set()
    assert a.done.wait(WAIT_S) and a.error is None


def test_a_sync_waits_for_every_pin_and_no_pin_is_granted_while_it_waits():
    gate = EngineGate()
    a, b = _Request(gate), _Request(gate)
    assert a.inside.wait(WAIT_S) and b.inside.wait(WAIT_S)
    got, synced = [], threading.Event()

    def sync():
        got.append(gate.acquire(timeout=WAIT_S))
        synced.set()

    threading.Thread(target=sync, daemon=True).start()
    with gate._cond:
        assert gate._cond.wait_for(lambda: gate._writers_waiting == 1, WAIT_S)
    late = _Request(gate, timeout=0.3)  # asks for a pin while the sync waits: refused, never runs
    assert late.done.wait(WAIT_S) and not late.inside.is_set()
    assert isinstance(late.error, GateError) and late.error.code == "UNAVAILABLE"
    a.finish.set()
    assert a.done.wait(WAIT_S) and not synced.is_set()  # B still holds its pin
    b.finish.set()
    assert b.done.wait(WAIT_S) and synced.wait(WAIT_S) and got == [True]
    c = _Request(gate, timeout=0.3)  # the sync holds the engine: no pin
    assert c.done.wait(WAIT_S) and not c.inside.is_set() and c.error.code == "UNAVAILABLE"
    gate.release()
    d = _Request(gate)
    assert d.inside.wait(WAIT_S)
    d.finish.set()
    assert d.done.wait(WAIT_S) and d.error is None


def test_a_cancelled_request_stops_alone():
    gate = EngineGate()
    active = {"a": True}
    a, b = _Request(gate, is_active=lambda: active["a"]), _Request(gate)
    assert a.inside.wait(WAIT_S) and b.inside.wait(WAIT_S)
    active["a"] = False
    a.finish.set()
    assert a.done.wait(WAIT_S) and isinstance(a.error, GateError) and a.error.code == "CANCELLED"
    assert not b.done.is_set() and gate.pins == 1
    b.finish.set()
    assert b.done.wait(WAIT_S) and b.error is None and gate.idle


def test_a_shared_turn_lends_by_waiting_and_stops_on_cancel():
    gate = EngineGate()
    active = {"on": True}
    with gate.pinned(WAIT_S, lambda: active["on"], takes_turns=False) as turn:
        assert turn.lend(lambda t: True, WAIT_S) is True
        active["on"] = False
        with pytest.raises(GateError) as exc:
            turn.lend(lambda t: False, WAIT_S)
        assert exc.value.code == "CANCELLED"
    assert gate.idle
