"""A rollout follows one trainer: the identity it is pinned to, and the rollback rule.

Every trainer carries an id (`trainer_id`: configured, or random per start) in PrepareSync and
CommitSync, on the token-authenticated control plane. The rollout pins the first id it commits a
sync from (or learns from its registration answer, or is configured with: `--trainer-id`) and
refuses PrepareSync / CommitSync from any other id with FAILED_PRECONDITION.

A restarted trainer with a random id is a new identity. The rollout adopts it only when it is the
trainer it registers with: on a new id it asks the trainer at its configured `trainer_address`
for that trainer's id, and re-pins when they match. A rollout without a trainer address (listed
statically by the trainer) keeps its pin until restarted, unless both sides are started with the
same `--trainer-id`, which survives restarts.

Versions are ordered within one trainer identity: a PrepareSync from the trainer that produced the
served version, with a lower version, is a rollback and is refused unless the request says
`allow_rollback` (`wsctl sync --allow-rollback`); an accepted rollback is logged and counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from weightsync.bus.errors import SyncError

log = logging.getLogger(__name__)


class TrainerPin:
    def __init__(
        self, configured_id: str = "", trainer_address: str = "", ask_trainer: Callable[[], str] | None = None
    ):
        self.configured_id = configured_id
        self.trainer_address = trainer_address
        #: returns the id of the trainer at `trainer_address` ("" when unreachable)
        self._ask_trainer = ask_trainer or (lambda: "")
        self.pinned = configured_id
        self.how = "configured with --trainer-id" if configured_id else ""
        #: the trainer id that produced the version being served ("" = initial weights)
        self.served_by = ""
        self._lock = threading.Lock()

    def learn(self, trainer_id: str, how: str) -> None:
        """Follow `trainer_id` as told by the trainer this rollout registers with (its registration answer).

        That trainer is the one at the configured address, so a new id from it is a restart and
        replaces the pin, unless the id is fixed by configuration.
        """
        with self._lock:
            if not trainer_id or trainer_id == self.pinned or self.configured_id:
                return
            if self.pinned:
                log.warning(
                    "the trainer at %s now has id %s (was %s): it restarted; following it",
                    self.trainer_address,
                    trainer_id,
                    self.pinned,
                )
            else:
                log.info("following trainer %s (%s)", trainer_id, how)
            self.pinned, self.how = trainer_id, how

    def _refusal(self, trainer_id: str, call: str) -> SyncError:
        return SyncError(
            f"{call} from trainer {trainer_id or '(no id)'!r} refused: this rollout follows trainer "
            f"{self.pinned!r} ({self.how}). A second trainer must not overwrite its weights. If this "
            "trainer replaced the old one on purpose, restart the rollout, or start both with the same "
            "--trainer-id",
            "FAILED_PRECONDITION",
        )

    def check(self, trainer_id: str, call: str = "PrepareSync") -> None:
        """Accept `trainer_id` or raise SyncError(FAILED_PRECONDITION) naming both ids and the fix."""
        with self._lock:
            if not self.pinned or trainer_id == self.pinned:
                return
            if self.configured_id or not self.trainer_address:
                raise self._refusal(trainer_id, call)
        # Outside the lock: one status call to the trainer this rollout registers with.
        current = self._ask_trainer()
        with self._lock:
            if trainer_id and current == trainer_id:
                log.warning(
                    "the trainer at %s now has id %s (was %s): it restarted; following it",
                    self.trainer_address,
                    trainer_id,
                    self.pinned,
                )
                self.pinned, self.how = trainer_id, f"the trainer at {self.trainer_address} (re-pinned after a restart)"
                return
            if trainer_id == self.pinned:
                return
            raise self._refusal(trainer_id, call)

    def committed(self, trainer_id: str) -> None:
        with self._lock:
            if not self.pinned:
                self.pinned, self.how = trainer_id, "the first trainer to commit a sync here"
                log.info("following trainer %s (%s)", trainer_id, self.how)
            self.served_by = trainer_id

    def check_rollback(self, trainer_id: str, version: int, served: int, allow: bool) -> bool:
        """True when this sync is an allowed rollback; SyncError when it is one and not allowed."""
        if version >= served or trainer_id != self.served_by or not self.served_by:
            return False
        if not allow:
            raise SyncError(
                f"sync to version {version} refused: this rollout serves version {served} from the same "
                f"trainer {trainer_id!r}, and going back is a rollback. To roll back on purpose, run "
                "`wsctl sync --allow-rollback`",
                "FAILED_PRECONDITION",
            )
        log.warning(
            "ROLLBACK accepted: trainer %s takes this rollout from version %d back to %d "
            "(allow_rollback was requested)",
            trainer_id,
            served,
            version,
        )
        return True
