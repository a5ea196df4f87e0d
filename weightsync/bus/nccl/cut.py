"""Cutting a member out of an NCCL stream: a collective cannot lose one rank, so the whole group is
aborted on the trainer and the live members are restarted in a group without it.

A broadcast needs every rank of its communicator. A member that stops (SIGSTOP, a hung host) without
dying still holds its connections, so NCCL waits for it and every other member waits with it until
the sync's deadline; the status watch (liveness.py) cannot tell it from a slow one either. The sync
link can: the trainer pings it during the stream (weightsync/publisher/stream_liveness.py) and a
member that leaves a ping unanswered for liveness_timeout_s is handed to `MemberCut.cut`, and so is one
the status watch finds dead or out of the sync (liveness.py: its verdict names the member). That aborts
the stream's communicator (ncclCommAbort on rank 0's group; with several senders, the sync's abort flag
that every sending rank answers by aborting its own) so the trainer's stream ends at once. NCCL tells
no other rank, so the publisher then sends the live members AbortSync (each aborts its communicator
and its transaction) and syncs them again, in a group built without the cut one
(weightsync/publisher/stream_cut.py). The cut member is left on its version; a later sync catches it up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class MemberCut:
    """The members of one sync's group and how to end its stream (`arm`ed once the stream has a group)."""

    def __init__(self, members: Iterable[str]):
        self.members = set(members)
        #: rollout id -> why it was cut, in the order they were
        self.why: dict[str, str] = {}
        self._abort: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def arm(self, abort: Callable[[str], None]) -> None:
        """`abort(reason)` ends the stream for every rank that sends it (idempotent)."""
        with self._lock:
            self._abort = abort

    def cut(self, rollout_id: str, why: str) -> bool:
        """End the stream because `rollout_id` can no longer take part (`why`); False when it cannot be
        (not a member, or no stream to end yet)."""
        with self._lock:
            abort = self._abort
            if abort is None or rollout_id not in self.members:
                return False
            self.why.setdefault(rollout_id, why)
        log.warning(
            "NCCL stream: cutting member %s out (%s); the live members are restarted without it", rollout_id, why
        )
        abort(f"member {rollout_id} cut out of the group: {why}")
        return True
