"""Colocated RL: a rollout hands its engine's GPU memory to the trainer for a train step, between two syncs.

`release` waits (bounded) for running requests under the engine gate, marks the transaction released and
has the engine free its memory (SGLang: `release_memory_occupation`, weights and KV cache; with
`enable_memory_saver` the weights' contents are lost). From then on generation is refused with UNAVAILABLE
(SyncTransaction.serve_turns) until a sync commits: the in-place apply's `begin_apply` maps the weights
again before the first bucket is written, `end_apply` maps the KV cache at commit, and the commit clears
the mark (SyncTransaction._finish_locked). A sync aborted meanwhile leaves the rollout refusing: before its
first bucket the weights are still released, after it they are half-written (STALE).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from weightsync.bus.errors import SyncError

log = logging.getLogger(__name__)


def release(tx: Any, timeout: float) -> tuple[str, ...]:
    """Release the engine memory of `tx` (a SyncTransaction), waiting at most `timeout` s for running
    requests; idempotent. Returns the engine's memory tags now released."""
    engine = tx.engine
    if not engine.releases_memory:
        raise SyncError(
            f"engine {engine.name!r} cannot release its GPU memory (SGLang does, started with "
            "--sglang-arg enable_memory_saver=true)",
            "FAILED_PRECONDITION",
        )
    if tx.apply_mode != "inplace":
        raise SyncError(
            f"apply_mode={tx.apply_mode}: a released engine must map its weights again before a sync's first "
            "bucket, which only the inplace apply does; run the rollout with --apply-mode inplace",
            "FAILED_PRECONDITION",
        )
    t0 = time.perf_counter()
    _refuse_during_sync(tx)
    # give_up: a sync prepared meanwhile goes first (its first bucket waits for this gate too)
    if not tx.engine_lock.acquire(timeout=timeout, give_up=lambda: tx.pending_sync_id != ""):
        _refuse_during_sync(tx)
        raise SyncError(f"requests still ran after {timeout:.0f} s; memory not released, retry", "UNAVAILABLE")
    try:
        with tx.state_lock:
            _refuse_during_sync(tx)
            tx.memory_released = True  # first: whatever the engine's release did before it failed, refuse
            # the engine no longer holds the delta base's bytes: the next sync writes every word
            tx.delta_base.engine_matches = False
            try:
                tags = engine.release_memory()
            except Exception as exc:  # the engine's own failure: say what it leaves behind
                raise SyncError(
                    f"the engine's memory release failed ({exc}); generation stays refused until a sync commits "
                    "(if syncs then fail too, restart the rollout)",
                    "INTERNAL",
                ) from exc
    finally:
        tx.engine_lock.release()
    log.info("released the engine's GPU memory %s in %.1f ms", list(tags), (time.perf_counter() - t0) * 1e3)
    tx._on_change()
    return tags


def _refuse_during_sync(tx: Any) -> None:
    if tx.pending_sync_id:
        raise SyncError(
            f"sync {tx.pending_sync_id} is in progress; release the memory between syncs, not during one",
            "FAILED_PRECONDITION",
        )
