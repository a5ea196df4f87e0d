"""CommitSync sent once the last bucket is handed to the bus, its answer read at the commit phase.

Over nccl and tcp the trainer knows every bucket's checksum before its last transfer completes (the
packed buckets are summed as they are packed; the actor's own buckets' sums start at prepare). A
rollout's commit waits for every bucket of the sync and checks every checksum before it applies
anything (rollout_svc/sync/transaction.py), so a commit that arrives early commits nothing early; it
only takes the commit's round trip, and the rollout's apply of the last bucket, off the sync's tail.
Where the trainer used to wait for its own last broadcast and then for the commit's answer, it now
waits for the two at once.

Only to a target on its sync link: the request goes out on the stream's thread, no thread takes the
call, and the link carries it while the last transfers complete. While the answer is not read, the
link's beats are not either, so the stream's liveness watch leaves such a target to the commit's own
liveness (StreamLiveness.calling), and a collective's status watch does not take one that committed
meanwhile for one that left the sync (Session.committing).

A stream that fails after the commits went out (the last broadcast broke): AbortSync goes to each of
them over gRPC (the link still carries the commit) and then the commit's answer is read. It is refused
when the abort reached the rollout first, or its last bucket never arrived whole: the rollout keeps its
version. It is committed only when every bucket had arrived and matched its checksum before the abort:
the rollout serves the whole new version, and the report says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Attempt(Protocol):
    """What early commits use of their attempt (weightsync.publisher.attempt.SyncAttempt)."""

    rollouts: Any
    by_id: dict
    manifest: Any
    prepared: dict
    delta: Any

    def linked(self, rid: str) -> bool: ...

    def commit_request(self, checksums: list[int]): ...
    def abort_request(self): ...
    def on_each(self, fn: Callable, items: list) -> list: ...


class EarlyCommits:
    def __init__(self, attempt: Attempt):
        self.attempt = attempt
        #: rollout_id -> reads the answer to the CommitSync sent to it (its link is taken until then)
        self._pending: dict[str, Callable[[], tuple]] = {}
        #: rollout_id -> (response, error) of its early CommitSync, once read
        self.answers: dict[str, tuple] = {}

    def last_sent(self, channel, checksums: list[int], silent, watch, session) -> None:
        """The last bucket went out on `channel`: CommitSync to every linked target still in the stream
        (not one the channel failed, nor one dropped as `silent`); the stream's liveness `watch` and the
        `session`'s own watch are told which ones now have a call on their link."""
        a, failed = self.attempt, channel.failures()
        rids = [rid for rid in a.prepared if a.linked(rid) and rid not in failed and rid not in silent]
        # a stream that keeps its buckets summed each as it diffed it (its channel's send): all are known
        sent = self.send(rids, list(a.delta.checksums) if a.delta.keep else checksums)
        if sent:
            session.committing(sent)
            if watch is not None:
                watch.calling.update(sent)

    def keep_committed(self, stream_failed: dict, prepared: dict, answered: dict) -> None:
        """A target whose stream failed after its commit went out, and whose commit applied every bucket
        checked before that: it serves the new version, so it goes back to `prepared` (its PrepareSync
        answer from `answered`) and the commit phase reports the answer it gave."""
        for rid in self.committed() & set(stream_failed):
            stream_failed.pop(rid)
            prepared[rid] = answered[rid]

    def send(self, rids: list[str], checksums: list[int]) -> list[str]:
        """CommitSync to each of `rids` on its sync link, answers unread; the ones it went out to (a
        target whose link is down now commits over gRPC at the commit phase instead)."""
        a = self.attempt
        req = a.commit_request(checksums)
        for rid in rids:
            finish = a.rollouts.send(a.by_id[rid], "CommitSync", req)
            if finish is not None:
                self._pending[rid] = finish
        return list(self._pending)

    def sent(self, rid: str) -> bool:
        return rid in self._pending or rid in self.answers

    def answer(self, rid: str) -> tuple:
        """(response, error) of the CommitSync sent to `rid` (read once; then kept)."""
        if rid not in self.answers:
            self.answers[rid] = self._pending.pop(rid)()
        return self.answers[rid]

    def committed(self) -> set[str]:
        return {rid for rid, (resp, err) in self.answers.items() if resp is not None and not err}

    def settle(self, why: str, rids=None) -> None:
        """The stream failed after the commits went out (to `rids`, default all): AbortSync to each over
        gRPC, then its answer. Nothing else may call a target on its link while its commit's answer is unread."""
        rids = [rid for rid in self._pending if rids is None or rid in rids]
        if not rids:
            return
        a = self.attempt
        req = a.abort_request()

        def abort_then_answer(rid: str) -> None:
            _, err = a.rollouts.call(a.by_id[rid], "AbortSync", req, link=False)
            if err:  # its commit still cannot apply a bucket that never came; its prepare timer aborts it
                log.warning("sync %s: AbortSync to %s (its commit sent early) failed: %s", a.manifest.sync_id, rid, err)
            resp, err = self.answer(rid)
            if resp is not None and not err:
                log.warning(
                    "sync %s: %s committed version %d before the trainer's stream failed (%s): every bucket "
                    "had arrived and matched its checksum",
                    a.manifest.sync_id,
                    rid,
                    resp.version,
                    why,
                )

        a.on_each(abort_then_answer, rids)
