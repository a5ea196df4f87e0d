"""Drops a target whose sync link goes silent while the buckets stream (issue 37).

A rollout can stop (SIGSTOP, a hung host) in the middle of a stream. Its kernel may go on taking
bytes for a while; once its buffers are full, its socket stops draining, and the bus channel's next
bucket (which goes to every target from the same buffer) waits on it. A stalled stream alone proves
nothing: a rollout that applies in place may be blocked, legitimately, until its in-flight generation
requests drain. Its sync link tells the two apart: the link thread answers a PING with a BEAT at once,
whatever the apply is doing (weightsync.control.sync_link), and a stopped or hung process answers
nothing.

So while the stream runs, every target on a sync link is pinged each BEAT_PERIOD_S, and one that has
left a ping unanswered for `timeout_s` (the trainer's liveness_timeout_s) is handed to `drop`: the caller
takes it out of the channel (its socket shut down, so the others' sends go on at once) and fails it
`silent`. A target without a link (gRPC only) gives no such signal and is not watched: its stream is
bounded by the sync's deadline, as before.

A target whose link is not open (a call broke it) cannot be asked, so its silence says nothing: it
is not judged until a ping goes out again. The link is opened right after the PrepareSync that named
it (weightsync.publisher.rollout_calls), so even a pairing's first stream is watched.

A target is dropped only on silence *and* no progress: with `progress(rid)` (the bus channel's bytes
sent to it, counted per chunk as its kernel takes them), a target whose stream moved since the last
round is not silent, whatever its link said: its process is receiving, only its link thread could not
answer in time (trainer and rollout in one process, a first sync's large copies and page faults). A
stopped process takes no more than its socket buffers, so its count stops with its answers.

Silence is counted from the oldest ping still unanswered, never from the last answer: a watch that
itself could not run for a while (its process busy, the GIL held by a long call) has sent no ping in
that time, so the target had nothing to answer. A round that comes late by more than half the timeout
judges no one: it restarts the count, since the answers may still be on their way to a busy process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from weightsync.control.sync_link import BEAT_PERIOD_S

log = logging.getLogger(__name__)


class Pingable(Protocol):
    """What the watch uses of a link (weightsync.publisher.link_client.SyncLinkClient)."""

    last_heard: float

    def ping(self) -> bool: ...


class StreamLiveness:
    """A thread, for the length of a `with` block, that drops the targets whose links fall silent.

    `drop(rid, silent_s)` runs on the watch's thread, once per target; `dropped` holds what it was
    given. A target is judged from the watch's start: an answer heard before the stream began does
    not count as silence during it."""

    def __init__(
        self,
        links: dict[str, Pingable],
        timeout_s: float,
        drop: Callable[[str, float], None],
        period: float = BEAT_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        progress: Callable[[str], object] | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"liveness timeout_s={timeout_s} must be > 0 (seconds)")
        # several pings per timeout: one lost to a full buffer or a busy GIL must not drop a live target
        self.links, self.timeout_s, self._drop = links, timeout_s, drop
        self.period = min(period, timeout_s / 4)
        #: rid -> seconds its link had been silent when it was dropped
        self.dropped: dict[str, float] = {}
        #: targets whose link now carries a call (a CommitSync sent before the last bucket completed):
        #: the answer's reader reads their beats, and that call's own liveness judges them
        self.calling: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock = clock
        #: rid -> when the oldest ping it has not answered was sent
        self._unanswered: dict[str, float] = {}
        self._last_round: float | None = None
        #: rid -> what progress(rid) said last round: a target whose stream moved is not silent
        self._progress, self._moved_at = progress, {}

    def __enter__(self) -> StreamLiveness:
        if self.links:
            self._thread = threading.Thread(target=self._run, name="stream-liveness", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            # a ping never blocks and a drop only shuts a socket down: one period is plenty
            self._thread.join(timeout=max(5.0, 4 * self.period))

    def check(self) -> None:
        """One round: ping every target still watched, and drop those that left a ping unanswered
        for timeout_s."""
        now = self._clock()
        late = self._last_round is not None and now - self._last_round > self.timeout_s / 2
        self._last_round = now
        for rid, link in self.links.items():
            if rid in self.dropped or rid in self.calling or self._stop.is_set():
                continue
            if not link.ping():  # reads the answers that came (last_heard), then asks again
                self._unanswered.pop(rid, None)  # no link to ask: its silence says nothing
                continue
            sent = self._unanswered.get(rid)
            if late or sent is None or link.last_heard >= sent or self._moved(rid):
                self._unanswered[rid] = self._clock()  # the ping just sent is the oldest unanswered
                continue
            silent = self._clock() - sent
            if silent >= self.timeout_s:
                self.dropped[rid] = silent
                try:
                    self._drop(rid, silent)
                except Exception:  # the watch must outlive one failed drop: the others still need it
                    log.exception("dropping silent target %s from the stream failed", rid)

    def _moved(self, rid: str) -> bool:
        """Whether `rid`'s stream took bytes since the last round: it is receiving, so it is alive even
        if its link thread could not answer (its process busy: trainer and rollout in one process)."""
        if self._progress is None:
            return False
        now = self._progress(rid)
        moved = rid in self._moved_at and now != self._moved_at[rid]
        self._moved_at[rid] = now
        return moved

    def _run(self) -> None:
        while True:
            self.check()
            if self._stop.wait(self.period):
                return
