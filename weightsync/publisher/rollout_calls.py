"""The trainer's calls to its rollouts during a sync: the narrow interface a SyncAttempt (and the
transports' trainer ends) use to reach a rollout, and how a failed target is recorded.

PrepareSync, CommitSync and AbortSync go over a rollout's sync link when it offered one
(weightsync.publisher.link_client), else — or when the link cannot be opened — over gRPC.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from weightsync.control.client import describe_rpc_error
from weightsync.control.sync_link import NUMBER_OF as LINK_METHODS
from weightsync.obs.metrics import SyncMetrics
from weightsync.publisher.link_client import LinkDown, SyncLinkClient
from weightsync.publisher.registry import RolloutEntry
from weightsync.sync_options import DEFAULTS
from weightsync.v1 import trainer_pb2

log = logging.getLogger(__name__)

#: the default liveness_timeout_s (trainer config bus.liveness_timeout_s)
LIVENESS_TIMEOUT_S = DEFAULTS.liveness_timeout_s


class RolloutCalls:
    def __init__(self, token: str, rpc_timeout: float, metrics: SyncMetrics, sync_link: bool = True):
        self.token = token
        self.rpc_timeout = rpc_timeout
        self.metrics = metrics
        #: use the sync links rollouts offer; False: every call over gRPC
        self.sync_link = sync_link
        #: a rollout silent this long on its sync link (no answer, no beat) is gone: its call fails then
        self.liveness_timeout: float | None = LIVENESS_TIMEOUT_S

    def call(self, entry: RolloutEntry, method: str, request, timeout: float | None = None, link: bool = True):
        """(response, "") or (None, "CODE: details"): over the rollout's sync link when it offered one
        (PrepareSync, CommitSync, AbortSync), else — or when the link cannot be opened — over gRPC.

        `timeout`: the call's bound instead of rpc_timeout_s, for a call whose handler waits on more
        than the rollout's own work (a PrepareSync that pauses generation); on the link, a rollout that
        goes silent still fails it after liveness_timeout_s. `link=False`: over gRPC, for a call that must
        not wait for the link's call in flight (an AbortSync while an early CommitSync is out on it)."""
        finish = self.send(entry, method, request, timeout) if link else None
        if finish is not None:
            return finish()
        timeout = self.rpc_timeout if timeout is None else timeout
        try:
            resp = getattr(entry.stub(self.token, timeout), method)(request)  # foreign: a gRPC stub's RPC by name
        except grpc.RpcError as exc:
            return None, describe_rpc_error(exc)
        finally:
            if method in LINK_METHODS:
                self.metrics.calls.labels("trainer", method, "grpc").inc()
        self._learn_link(entry, method, resp)
        return resp, ""

    def send(
        self, entry: RolloutEntry, method: str, request, timeout: float | None = None
    ) -> Callable[[], tuple] | None:
        """`call` over the rollout's sync link in two halves: the request goes out now and the function
        returned reads its answer, so the caller's own work runs in between on the caller's thread (no
        hand-off to another thread and back). None, with nothing sent, when the call cannot go over the
        link now (no link offered, or it could not be opened): `call` then takes gRPC. The caller must call
        the function, also when its work in between fails: the link carries one request at a time."""
        timeout = self.rpc_timeout if timeout is None else timeout
        link = self.link_of(entry) if method in LINK_METHODS else None
        if link is None:
            return None
        try:
            answer = link.send(method, request, timeout, self.liveness_timeout)
        except LinkDown as exc:
            log.warning(
                "%s; %s goes over gRPC (the link is tried again in %.0fs)",
                exc,
                method,
                max(0.0, link.retry_at - time.monotonic()),
            )
            return None

        def finish() -> tuple:
            resp, err = answer()
            self.metrics.calls.labels("trainer", method, "link").inc()
            self._learn_link(entry, method, resp)
            return resp, err

        return finish

    def link_of(self, entry: RolloutEntry) -> SyncLinkClient | None:
        """The sync link `entry`'s next PrepareSync / CommitSync / AbortSync takes; None: gRPC."""
        link = entry.link if self.sync_link else None
        return link if link is not None and link.usable() else None

    def gone(self, entry: RolloutEntry) -> bool:
        """The rollout went silent on its sync link in this sync: a call to it would only wait."""
        link = entry.link if self.sync_link else None
        return link is not None and link.silent

    def heard_since(self, entry: RolloutEntry, since: float) -> bool | None:
        """Whether the rollout said anything on its sync link since monotonic time `since` (a call on the
        link is acknowledged at once); None when its calls go over gRPC, which gives no such signal."""
        link = self.link_of(entry)
        if link is None or self.liveness_timeout is None:
            return None
        return link.last_heard >= since

    def _learn_link(self, entry: RolloutEntry, method: str, resp) -> None:
        # only an accepted prepare names the link (a manifest_needed answer is not one)
        if self.sync_link and method == "PrepareSync" and resp is not None and not resp.manifest_needed:
            entry.offer_link(resp.sync_link, self.token)
            if entry.link is not None:
                # now, not at the commit: the stream that follows is watched on it (stream_liveness)
                entry.link.open(self.rpc_timeout, self.liveness_timeout)

    def open_stream(self, entry: RolloutEntry, method: str, requests, timeout: float):
        """A streaming call to a rollout (IpcBuckets): its response iterator; raises grpc.RpcError."""
        return getattr(entry.stub(self.token, timeout), method)(requests, timeout=timeout)  # foreign: gRPC stub

    def fail(self, result: trainer_pb2.RolloutSyncResult, entry: RolloutEntry, reason: str, err: str) -> None:
        result.ok, result.error = False, err
        entry.last_error = err
        self.metrics.failure(reason)
        log.warning("sync to %s failed (%s): %s", entry.rollout_id, reason, err)
