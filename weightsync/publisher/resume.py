"""A restarted publisher continues its trainer's version line instead of starting it again at 1.

A rollout refuses a lower version from the trainer whose version it serves (a rollback:
rollout_svc/sync/pinning.py). A training job that crashes and resumes builds a new Publisher with the
same `trainer_id`, whose count starts at 0, so every rollout would refuse it until its versions passed
the old ones. The rollouts say, in the status the trainer reads when they register, which trainer
they follow and which version they serve: the next version is one past the highest of those that
follow this trainer id. Versions stay monotonic for every rollout, and the rollback rule is unchanged
for anyone else (a lower version is still refused without `allow_rollback`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def resume_version(current: int, entries, trainer_id: str) -> int:
    """The version to count on from: `current`, or the highest version a rollout following
    `trainer_id` reported, whichever is higher."""
    held = [e.version for e in entries if e.trainer_id == trainer_id and e.version > current]
    if not held:
        return current
    top = max(held)
    log.warning(
        "trainer %s: rollouts already serve version %d of this trainer id (a restarted publisher); "
        "continuing from it, so the next sync is version %d",
        trainer_id,
        top,
        top + 1,
    )
    return top
