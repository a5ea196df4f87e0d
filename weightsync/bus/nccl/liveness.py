"""End an NCCL stream within about a second when one of its ranks can no longer take part.

A broadcast needs every rank, and NCCL tells nobody when one is gone: a rollout process that dies
mid-stream, or one that aborted its side of the sync (a bad checksum, its own deadline) and so
stopped receiving, leaves the trainer and every other rollout waiting until the sync's timeout,
minutes by default. The control plane sees both at once — a dead process's gRPC port refuses
connections; a live one reports that it no longer holds the sync — so `Watch` asks a probe once
per period and aborts on the first verdict. Slow or busy answers are not verdicts: only a refused
or reset connection, or a status that left the sync, counts (the stream's own timeout still
bounds a hung member).

With several sending trainer ranks (a multi-sender sync) only global rank 0 talks to the
rollouts, yet every sender's broadcast must end: rank 0's verdict is raised as a flag on the
trainer job's own store (`StoreFlags`), which every sending rank watches in the same way. The same
store carries the targets rank 0 drops from a multi-sender TCP stream (`drop_target`: one that went
silent mid-stream), which every sender drops from its own connections (publisher/drop_follow.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Callable

from weightsync.bus.session import RpcCall
from weightsync.bus.workers import Job, Workers
from weightsync.v1 import rollout_pb2

log = logging.getLogger(__name__)

Probe = Callable[[], str]  # "" while all is well, else why the stream must end
#: the watches' threads, kept across syncs (weightsync/bus/workers.py)
WATCHES = Workers("nccl-liveness")


class Watch:
    def __init__(
        self,
        probe: Probe,
        abort: Callable[[str], None],
        period: float,
        what: str = "NCCL group",
        on_stop: Callable[[], None] | None = None,
    ):
        """`on_stop`: releases what the probe holds (its RPC threads) when the watch stops."""
        self.probe, self.abort, self.period, self.what, self.on_stop = probe, abort, period, what, on_stop
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a verdict is given before stop() returns, or never
        self.tripped = ""
        self._job: Job | None = None

    def start(self) -> "Watch":
        self._job = WATCHES.submit(self._run)  # a kept thread: none is started per sync
        return self

    def stop(self) -> None:
        """Stop watching; returns at once (a probe in flight is left to finish and ignored)."""
        with self._lock:
            self._stop.set()
        if self.on_stop is not None:
            self.on_stop()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                verdict = self.probe()
            except Exception as exc:  # noqa: BLE001 — a probe that cannot ask is no verdict; the timeout still bounds
                log.warning("%s liveness probe failed (ignored): %s", self.what, exc)
                continue
            if not verdict:
                continue
            with self._lock:
                if self._stop.is_set():
                    return  # the stream ended first: the group is fine, keep it
                self.tripped = verdict
            log.warning("%s aborted: %s", self.what, verdict)
            self.abort(verdict)
            return


class MembersProbe:
    """Asks every member (rollout id -> registry entry) for its status, all at once; a verdict for the
    first that is unreachable or no longer holds `sync_id`.

    In parallel, because one member whose answer hangs (until the RPC timeout, tens of seconds) must not
    hide another that died; a member still answering the previous round is not asked again, so a
    hung one holds one thread, not one per period."""

    def __init__(self, members: dict, call: RpcCall, sync_id: str, wait_s: float = 1.0):
        self.members, self.call, self.sync_id, self.wait_s = dict(members), call, sync_id, wait_s
        self._pool: ThreadPoolExecutor | None = None
        self._asked: dict[str, Future] = {}
        self._closed = False
        self._lock = threading.Lock()  # close() and a round's submissions exclude each other
        #: the member the last verdict was about ("" before any): the stream cuts it (cut.py)
        self.culprit = ""
        #: members sent their CommitSync before the last broadcast completed: one that no longer holds
        #: the sync may have committed it, which its commit's answer says; only an unreachable one is a verdict
        self.committing: set[str] = set()

    def __call__(self) -> str:
        if len(self.members) == 1:
            ((rid, entry),) = self.members.items()
            return self._verdict(rid, *self.call(entry, "GetStatus", rollout_pb2.GetStatusRequest()))
        with self._lock:
            if self._closed:
                return ""
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(len(self.members), 32), thread_name_prefix="nccl-probe")
            for rid, entry in self.members.items():
                if rid not in self._asked:
                    self._asked[rid] = self._pool.submit(self.call, entry, "GetStatus", rollout_pb2.GetStatusRequest())
        rid_of = {f: rid for rid, f in self._asked.items()}
        try:
            for f in as_completed(rid_of, timeout=self.wait_s):  # the first verdict ends the round
                del self._asked[rid_of[f]]
                verdict = self._verdict(rid_of[f], *f.result())  # a call that raised: the watch logs it
                if verdict:
                    return verdict
        except FuturesTimeout:
            pass  # the slow ones stay asked; their answers count in a later round
        return ""

    def _verdict(self, rid: str, resp, err: str) -> str:
        verdict = ""
        if err.startswith("UNAVAILABLE"):
            verdict = f"rollout {rid} became unreachable during the stream ({err})"
        elif not err and resp is not None and resp.pending_sync_id != self.sync_id and rid not in self.committing:
            verdict = (
                f"rollout {rid} left sync {self.sync_id} during the stream ({resp.last_error or 'no error given'})"
            )
        if verdict:
            self.culprit = rid
        return verdict

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # a call in flight ends with its own RPC timeout


def members_probe(members: dict, call: RpcCall, sync_id: str, wait_s: float = 1.0) -> MembersProbe:
    return MembersProbe(members, call, sync_id, wait_s)


class StoreFlags:
    """Per-sync abort flags on a store every trainer rank reaches (torch.distributed's own store of
    the trainer job): nothing new listens, and only the job's ranks can raise or read them. A read
    on another rank's connection right after a set may not see it yet, so readers poll (Watch)
    rather than read once."""

    PREFIX = "weightsync/stream-abort/"
    #: targets dropped from a sync's streams (multi-sender TCP: every sender drops them), numbered 1..n
    DROPS = "weightsync/stream-drop/"

    def __init__(self, store):
        self.store = store

    def raise_flag(self, sync_id: str, reason: str) -> None:
        self.store.set(self.PREFIX + sync_id, reason.encode()[:4096])

    def raised(self, sync_id: str) -> str:
        key = self.PREFIX + sync_id
        if not self.store.check([key]):
            return ""
        return self.store.get(key).decode(errors="replace") or "aborted"

    def drop_target(self, sync_id: str, rollout_id: str, reason: str) -> None:
        """Tell every sender of `sync_id` to drop `rollout_id` from its stream (it went silent)."""
        n = self.store.add(f"{self.DROPS}{sync_id}/n", 1)
        self.store.set(f"{self.DROPS}{sync_id}/{n}", f"{rollout_id}\n{reason}".encode()[:4096])

    def dropped(self, sync_id: str) -> dict[str, str]:
        """rollout id -> why, for every target dropped from `sync_id`'s streams so far."""
        count = f"{self.DROPS}{sync_id}/n"
        if not self.store.check([count]):  # asked before any drop: no key is made per sync
            return {}
        out: dict[str, str] = {}
        for i in range(1, self.store.add(count, 0) + 1):
            key = f"{self.DROPS}{sync_id}/{i}"
            if not self.store.check([key]):  # counted, not yet written: the next poll reads it
                break
            rid, _, why = self.store.get(key).decode(errors="replace").partition("\n")
            out.setdefault(rid, why)
        return out


class LocalFlags:
    """The same flags within one process (a single-rank trainer, tests)."""

    def __init__(self):
        self._flags: dict[str, str] = {}
        self._drops: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def raise_flag(self, sync_id: str, reason: str) -> None:
        with self._lock:
            self._flags.setdefault(sync_id, reason or "aborted")

    def raised(self, sync_id: str) -> str:
        with self._lock:
            return self._flags.get(sync_id, "")

    def drop_target(self, sync_id: str, rollout_id: str, reason: str) -> None:
        with self._lock:
            self._drops.setdefault(sync_id, {}).setdefault(rollout_id, reason)

    def dropped(self, sync_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self._drops.get(sync_id, {}))
