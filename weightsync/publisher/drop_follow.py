"""A sending rank of a multi-sender TCP stream drops the targets rank 0 found silent.

Every trainer rank that owns buckets streams them on its own connections to every rollout
(weightsync/publisher/multisender.py), and only global rank 0 talks to the rollouts' sync links, so
only rank 0 can tell that one went silent mid-stream (weightsync/publisher/stream_liveness.py). It
says so on the trainer job's own store (`StoreFlags.drop_target`, weightsync/bus/nccl/liveness.py);
this thread, on each sending rank, reads those drops every period and shuts that target's socket down
on this rank too (`TcpBucketSender.drop`), which ends a send blocked on it: the rank's other targets
stream on, and its report names the dropped one.
"""

from __future__ import annotations

import logging
import threading

from weightsync.control.sync_link import BEAT_PERIOD_S

log = logging.getLogger(__name__)


class DropFollower:
    """For the length of one rank's stream; the interface of the NCCL flag watch (stop, tripped), which
    it never trips: a drop ends one target's stream, not the rank's."""

    def __init__(self, flags, sync_id: str, sender, period: float = BEAT_PERIOD_S):
        self.flags, self.sync_id, self.sender, self.period = flags, sync_id, sender, period
        self.tripped = ""
        self.dropped: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-drop-follow", daemon=True)

    def start(self) -> DropFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following; returns at once (a poll in flight ends on its own)."""
        self._stop.set()

    def poll(self) -> None:
        for rid, why in self.flags.dropped(self.sync_id).items():
            if rid not in self.dropped:
                self.dropped[rid] = why
                if self.sender.drop(rid, why):
                    log.warning("sync %s: %s dropped from this rank's stream: %s", self.sync_id, rid, why)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.poll()
            except Exception:  # a store that cannot be read now: the next poll asks again; the deadline bounds
                log.exception("sync %s: reading the stream's drops failed", self.sync_id)


def follow_drops(actor, sync_id: str, sender) -> DropFollower | None:
    """The follower of this rank's stream, when the actor has the job's flags (a multi-rank trainer)."""
    flags = actor.stream_flags
    if flags is None:
        return None
    return DropFollower(flags, sync_id, sender).start()
