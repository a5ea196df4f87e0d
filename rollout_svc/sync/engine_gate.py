"""Who may use the engine, and when: syncs exclusively, requests pinned to a version, and (for an engine that
does not batch requests itself) taking turns.

Two levels:
- Version pins. A request pins the weights for its whole run; a sync that wants to change them
  (the exclusive side, `acquire`/`release`, used by rollout_svc.sync.transaction like a lock) waits until
  no request holds a pin, and while it waits no new pin is granted, so a stream of requests cannot
  starve a sync. A response is therefore computed from one version only, even though requests
  run at the same time or interleave: the weights never change under a pinned request.
- Turns, for an engine that runs one request at a time (the built-in engine; `pinned(takes_turns=True)`).
  Pinned requests share the engine one step at a time. An engine that supports it calls
  `turn()` between decode steps; the request then hands the engine to a waiting request that has
  had at least MIN_LEAD_STEPS fewer steps (least attained service first, FIFO among equals), so a
  short request waits about one step of a long one instead of the whole long request. `turn()` is also
  where a request whose client went away (cancelled, deadline passed, HTTP disconnect) stops.
  An engine that batches concurrent requests itself (`Engine.batches_requests`: SGLang's continuous
  batching) takes no turns (`pinned(takes_turns=False)`): every pinned request runs at once, on its
  own thread, and its Turn only checks its client (`turn()`, `lend` wait without handing anything over).

A request that must wait for something else between two steps (a stream whose reader has no room
for its tokens: openai_api/streaming.py) lends the engine meanwhile (`Turn.lend`): other requests take
turns while it waits, and it takes a turn again (as any waiter, least steps first) once it may go on.

Every wait is bounded: a request that cannot get a pin or a turn within its timeout is refused
with UNAVAILABLE, and waiting turns re-check their client every 100 ms.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from weightsync.bus.errors import SyncError


class GateError(SyncError):
    """A request that got no pin or turn in time (UNAVAILABLE) or whose client went away (CANCELLED);
    mapped onto a gRPC status by the service layer like any SyncError."""


_POLL_S = 0.1
# A request hands the engine over only to a waiter this many steps behind it. Handing over at
# every step would make requests of similar length alternate step by step, each hand-over costing
# a thread wake-up (milliseconds on a loaded host); with a lead, similar requests run one after
# the other, and a short request still overtakes a long one after at most this many
# steps of it.
MIN_LEAD_STEPS = 16

#: lend(ready, timeout) -> came: let other requests use the engine while waiting at most `timeout` s
#: for what `ready(t)` says came (it waits at most t s itself, True: it came, stop waiting); then take
#: a turn again. Returns ready's last answer. A request that does not take turns just waits (`no_lend`).
Lend = Callable[[Callable[[float], bool], float], bool]


def no_lend(ready: Callable[[float], bool], timeout: float) -> bool:
    """A Lend for a request that holds no turn: it waits (polling `ready`), no more."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if ready(min(left, _POLL_S)):
            return True


class Turn:
    """One request's handle: call it between engine steps."""

    def __init__(self, gate: "EngineGate", ticket: int, is_active: Callable[[], bool], timeout: float):
        self.gate, self.ticket, self.is_active, self.timeout = gate, ticket, is_active, timeout
        self.steps = 0

    def check(self) -> None:
        if not self.is_active():
            raise GateError("request cancelled by the client (or its deadline passed); generation stopped", "CANCELLED")

    def __call__(self) -> None:
        self.check()
        self.steps += 1
        self.gate._yield_to_fewer_steps(self)

    def lend(self, ready: Callable[[float], bool], timeout: float) -> bool:
        """A Lend: the engine goes to other requests while this one waits for `ready`; raises (as a
        turn does) if this request is cancelled, or gets no turn back within its timeout."""
        self.gate._hand_over(self)
        came = no_lend(lambda t: ready(t) or not self.is_active(), timeout)  # a cancel ends the wait too
        self.check()
        self.gate._take_turn(self)
        return came


class SharedTurn(Turn):
    """The handle of a request on an engine that batches requests itself: it runs alongside the others, so
    there is no turn to hand over; it only stops once its client went away."""

    def __call__(self) -> None:
        self.check()
        self.steps += 1

    def lend(self, ready: Callable[[float], bool], timeout: float) -> bool:
        came = no_lend(lambda t: ready(t) or not self.is_active(), timeout)
        self.check()
        return came


class EngineGate:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._exclusive = False
        self._writers_waiting = 0
        self._pins = 0
        self._holder: Turn | None = None  # the pinned request running on the engine now
        self._queue: dict[int, Turn] = {}  # pinned requests waiting for a turn
        self._tickets = itertools.count()

    # ---- exclusive side: a sync changing the weights (lock-like) -------------------------
    def acquire(self, blocking: bool = True, timeout: float = -1, give_up: Callable[[], bool] | None = None) -> bool:
        """Lock-like; `give_up` (checked every 100 ms while waiting) ends the wait early, False."""
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._exclusive or self._pins:
                    if not blocking or (give_up is not None and give_up()):
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    if give_up is not None:  # wake to ask it
                        left = _POLL_S if left is None else min(left, _POLL_S)
                    self._cond.wait(left)
                self._exclusive = True
                return True
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # pins held back by this writer may go on if it gave up

    def release(self) -> None:
        # No owner check: an abort on a timer thread releases what a receiver thread acquired.
        with self._cond:
            if not self._exclusive:
                raise RuntimeError("EngineGate.release() without acquire()")
            self._exclusive = False
            self._cond.notify_all()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    # ---- request side -------------------------------------------------------------------
    @contextmanager
    def pinned(self, timeout: float, is_active: Callable[[], bool] = lambda: True, takes_turns: bool = True):
        """Hold a version pin, and with `takes_turns` the first turn; yields the request's Turn. Without
        `takes_turns` (an engine that batches requests itself) the request runs as soon as it holds its pin,
        alongside every other pinned request (a SharedTurn)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._exclusive or self._writers_waiting:
                self._wait(deadline, is_active, "engine busy applying weights; retry")
            self._pins += 1
        if not takes_turns:
            try:
                yield SharedTurn(self, next(self._tickets), is_active, timeout)
            finally:
                with self._cond:
                    self._pins -= 1
                    self._cond.notify_all()
            return
        turn = Turn(self, next(self._tickets), is_active, timeout)
        try:
            with self._cond:
                self._queue[turn.ticket] = turn
                try:
                    while not self._my_turn(turn):
                        self._wait(deadline, is_active, "engine busy with other requests; retry")
                finally:
                    self._queue.pop(turn.ticket, None)
                self._holder = turn
            yield turn
        finally:
            with self._cond:
                if self._holder is turn:
                    self._holder = None
                self._pins -= 1
                self._cond.notify_all()

    def locked(self) -> bool:
        """True while a sync holds the engine or any request holds a version pin (Lock-like)."""
        return self._exclusive or self._pins > 0

    @property
    def pins(self) -> int:
        return self._pins

    @property
    def idle(self) -> bool:
        return not self._pins and not self._exclusive and self._holder is None

    def _my_turn(self, turn: Turn) -> bool:
        if self._holder is not None:
            return False
        best = min(self._queue.values(), key=lambda t: (t.steps, t.ticket))
        return best is turn

    def _wait(self, deadline: float, is_active: Callable[[], bool], busy: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GateError(busy, "UNAVAILABLE")
        if not is_active():
            raise GateError("request cancelled by the client (or its deadline passed) while queued", "CANCELLED")
        self._cond.wait(min(left, _POLL_S))

    def _yield_to_fewer_steps(self, turn: Turn) -> None:
        with self._cond:
            keep = not any(t.steps + MIN_LEAD_STEPS <= turn.steps for t in self._queue.values())
        if keep:
            # Nobody waiting has had less: keep the engine (no hand-over cost), but let other Python
            # threads run for a moment: a new request's gRPC/HTTP handling needs the GIL to reach the
            # queue at all, and would otherwise wait for the interpreter's switch interval, repeatedly.
            time.sleep(0)
            return
        self._hand_over(turn)
        self._take_turn(turn)

    def _hand_over(self, turn: Turn) -> None:
        """`turn` stops using the engine: a waiting request may take it."""
        with self._cond:
            if self._holder is turn:
                self._holder = None
            self._cond.notify_all()

    def _take_turn(self, turn: Turn) -> None:
        """Wait (bounded by the request's timeout, and while its client is there) for `turn` to hold the engine."""
        with self._cond:
            self._queue[turn.ticket] = turn
            self._cond.notify_all()
            deadline = time.monotonic() + turn.timeout
            try:
                while not self._my_turn(turn):
                    self._wait(deadline, turn.is_active, "engine busy with other requests; retry")
            finally:
                self._queue.pop(turn.ticket, None)
            self._holder = turn
