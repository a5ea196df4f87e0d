"""How the stream phase takes out a target that went silent mid-stream, whatever carries it.

A channel that reaches each target on its own connection (tcp) drops that one target and the others
stream on (weightsync.bus.channel.BucketSender.drop). A collective (nccl) cannot lose one rank: the
session cuts the member out by ending the stream for every rank (weightsync/bus/nccl/cut.py), the
live members are sent AbortSync (NCCL tells no other rank that the trainer aborted, so each must
abort its own communicator) and become the targets of a restart of the sync, which the orchestrator
runs at once in a group built without the cut member. The restart streams every bucket again, under
a new sync id, with its own checksums: a rollout applies a sync's buckets in one transaction that
the abort ended, so resuming mid-stream could not prove what it applied. The healthy members
therefore commit after the cut member's silence (liveness_timeout_s), one group build and one whole
stream. With several sending ranks over tcp, rank 0 alone talks to the rollouts: it raises a drop
flag on the trainer job's store and every rank drops the target from its own connections
(weightsync/publisher/drop_follow.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from weightsync.bus.channel import drops_targets

log = logging.getLogger(__name__)

Drop = Callable[[str, str], bool]  # (rollout id, why) -> whether it left the stream


def stream_drop(session, channel) -> Drop | None:
    """How to take one silent target out of this stream: the channel's own drop, the session's cut of
    the whole group, or None (neither can: the stream keeps every target and the deadline bounds it)."""
    if channel is not None and drops_targets(channel):
        return channel.drop
    return session.cut if session.group_wide else None


def owners_drop(session, flags, sync_id: str) -> Drop | None:
    """The same for a stream from several trainer ranks: a collective session's cut (every sender's
    group ends through the sync's abort flag), or, over tcp, a drop flag every sending rank follows."""
    if session.group_wide:
        return stream_drop(session, None)
    if flags is None:
        return None  # an actor without the job's store: the deadline bounds the stream

    def drop(rid: str, why: str) -> bool:
        flags.drop_target(sync_id, rid, why)
        return True

    return drop


def restart_live(attempt, session, failed: dict[str, str]) -> dict[str, str]:
    """After a collective's stream ended because members were cut (silent mid-stream; or dead
    or out of the sync, as the status watch found): send the live members AbortSync, make them the
    targets of a restart (`attempt.retry`) and leave their results to it; the failures still to report
    are returned (the cut members', each with why it was cut)."""
    cut = {rid: why for rid, why in session.cut_reasons().items() if rid in failed}
    if not session.group_wide or not cut:
        return failed
    live = [rid for rid in failed if rid not in cut]
    req = attempt.abort_request()
    answers = attempt.on_each(lambda r: attempt.rollouts.call(attempt.by_id[r], "AbortSync", req), live)
    attempt.aborted.update(live)
    for rid, (_, err) in zip(live, answers):
        if err:  # it will not take the restart's prepare either, or answers it with its own error
            log.warning("sync %s: AbortSync to %s before the restart failed: %s", attempt.manifest.sync_id, rid, err)
    attempt.retry = [attempt.by_id[rid] for rid in live]
    note = f"{session.name}: restarted without {', '.join(sorted(cut))}, cut out of the group mid-stream"
    for rid in live:  # superseded by the restart's result: not a failure of this rollout
        attempt.results[rid].ok, attempt.results[rid].error = False, note
    log.warning("sync %s: %s; restarting for %s", attempt.manifest.sync_id, note, ", ".join(live) or "no one")
    return cut
