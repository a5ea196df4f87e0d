"""Answers from every target of a sync phase at once, without waiting on one that went silent (issue 37).

A phase (PrepareSync, CommitSync) sends its request to every target together. A rollout on a sync
link acknowledges a request the moment it reads it (a BEAT frame, weightsync.control.sync_link), so
a target whose link has said nothing at all since its request went out, while the others have
answered, is not slow but gone (stopped, hung, unreachable). It is dropped from the phase once a grace
has passed since the requests went out: `grace_s(answered)`, GRACE_FACTOR times the slowest answer of
the others, at least GRACE_FLOOR_S, so the healthy targets wait for it only a bound set by their own
progress — not a full liveness_timeout_s, and never rpc_timeout_s.

A target that acknowledged (it beats) is slow, not gone: it is waited for as before (its link gives up
after liveness_timeout_s of silence). A target reached over gRPC gives no such signal and is waited for
too. A dropped target's call still runs to its own end on the RPC pool: `on_late` gets its answer,
so the caller can supersede what that answer did (abort a late prepare) instead of trusting it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent import futures
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: never drop a target sooner than this after the requests went out: on a loaded host a healthy
#: rollout's acknowledgement can take milliseconds to be scheduled (a healthy rollout dropped by
#: mistake only misses this sync: it is caught up by the next)
GRACE_FLOOR_S = 0.05
#: ... nor sooner than this many times the slowest answer of the targets that answered
GRACE_FACTOR = 2.0
#: at most this long the caller's own work (`meanwhile`) waits for every call to be on its thread
SENDING_WAIT_S = 0.005


def grace_s(answered: list[float]) -> float:
    """How long after the requests went out a silent target is dropped, given the others' answer times."""
    return max(GRACE_FLOOR_S, GRACE_FACTOR * max(answered, default=0.0))


@dataclass
class Gathered:
    #: key -> the call's result, for every target that answered in time
    answers: dict = field(default_factory=dict)
    #: key -> seconds it had been silent when dropped (its call still runs; `on_late` gets the answer)
    dropped: dict = field(default_factory=dict)
    #: seconds from the requests going out to the slowest answer kept
    seconds: float = 0.0


def gather(
    pool: futures.Executor,
    calls: dict[Hashable, Callable[[], object]],
    heard_since: Callable[[Hashable, float], bool | None],
    deadline: float,
    *,
    meanwhile: Callable[[], None] | None = None,
    on_late: Callable[[Hashable, object], None] | None = None,
) -> Gathered:
    """Run every call at once and collect their results, dropping the targets that stay silent.

    `heard_since(key, t)`: whether the target said anything since monotonic time `t` (None: no way to
    tell, it is waited for). `deadline` (time.monotonic()) bounds the wait for the calls that are
    kept; each call has its own timeout too. `meanwhile` runs once every request is out (each call
    started on its thread, `_submit_then_yield`), before the answers are read: the caller's own work
    overlaps the targets'. A single target without
    `meanwhile` is called on this thread: there is no other to compare it with."""
    out = Gathered()
    t0 = time.monotonic()
    if len(calls) == 1 and meanwhile is None:
        ((key, fn),) = calls.items()
        out.answers[key] = fn()
        out.seconds = time.monotonic() - t0
        return out
    if meanwhile is None:
        pending = {pool.submit(fn): key for key, fn in calls.items()}
    else:
        pending = _submit_then_yield(pool, calls)
        try:
            meanwhile()
        except BaseException:  # the calls already out end before the failure is raised
            futures.wait(pending, timeout=max(0.001, deadline - time.monotonic()))
            raise
    took: list[float] = []
    waiting_on_alive: set = set()  # acknowledged: slow, not gone
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        cut = t0 + grace_s(took) if took else deadline
        unsure = [f for f in pending if f not in waiting_on_alive]
        done, _ = futures.wait(
            pending,
            timeout=max(0.0, min(deadline, cut if unsure else deadline) - now),
            return_when=futures.FIRST_COMPLETED,
        )
        for f in done:
            out.answers[pending.pop(f)] = f.result()
            took.append(time.monotonic() - t0)
        if not took or time.monotonic() < t0 + grace_s(took):
            continue
        for f in [f for f in pending if f not in waiting_on_alive]:
            key = pending[f]
            heard = heard_since(key, t0)
            if heard is False and not f.done():
                out.dropped[key] = time.monotonic() - t0
                del pending[f]
                if on_late is not None:
                    f.add_done_callback(lambda f, key=key: _late(on_late, key, f))
            else:
                waiting_on_alive.add(f)
    for f, key in pending.items():  # past the deadline: the calls end on their own timeouts
        out.answers[key] = f.result()
    out.seconds = max(took, default=time.monotonic() - t0)
    return out


def _submit_then_yield(pool: futures.Executor, calls: dict) -> dict:
    """Submit every call and return once each has started on its thread (at most SENDING_WAIT_S).

    The caller's work that follows (`meanwhile`: launching the trainer's GPU work, milliseconds of
    Python) holds the GIL: started first, it would hold back the requests, whose threads need the
    GIL to send them, and its time would add to the round trip instead of overlapping it. A call's
    thread keeps the GIL from its start until it blocks sending its request (the socket write releases
    it), so once every call has started the requests go out before the caller's work runs."""
    started = threading.Semaphore(0)

    def starting(fn):
        started.release()
        return fn()

    pending = {pool.submit(starting, fn): key for key, fn in calls.items()}
    until = time.monotonic() + SENDING_WAIT_S
    for _ in calls:
        if not started.acquire(timeout=max(0.0, until - time.monotonic())):
            break  # the pool is busy: the caller's work need not wait for it
    return pending


def _late(on_late: Callable, key, fut: futures.Future) -> None:
    try:
        on_late(key, fut.result())
    except Exception:  # a late answer's handling must never break the pool thread that delivered it
        log.exception("handling the late answer of %s failed", key)
