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
trainer job's own store (`StoreFlags`), which every sending rank watches in the same way.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from weightsync.bus.session import RpcCall
from weightsync.v1 import rollout_pb2

log = logging.getLogger(__name__)

Probe = Callable[[], str]  # "" while all is well, else why the stream must end


class Watch:
    def __init__(self, probe: Probe, abort: Callable[[str], None], period: float, what: str = "NCCL group"):
        self.probe, self.abort, self.period, self.what = probe, abort, period, what
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a verdict is given before stop() returns, or never
        self.tripped = ""
        self._thread = threading.Thread(target=self._run, name="nccl-liveness", daemon=True)

    def start(self) -> "Watch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; returns at once (a probe in flight is left to finish and ignored)."""
        with self._lock:
            self._stop.set()

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


def members_probe(members: dict, call: RpcCall, sync_id: str) -> Probe:
    """Ask every member (rollout id -> registry entry) for its status; a verdict for the first that
    is unreachable or no longer holds `sync_id`."""
    members = dict(members)

    def probe() -> str:
        for rid, entry in members.items():
            resp, err = call(entry, "GetStatus", rollout_pb2.GetStatusRequest())
            if err.startswith("UNAVAILABLE"):
                return f"rollout {rid} became unreachable during the stream ({err})"
            if not err and resp is not None and resp.pending_sync_id != sync_id:
                return (f"rollout {rid} left sync {sync_id} during the stream "
                        f"({resp.last_error or 'no error given'})")
        return ""
    return probe


class StoreFlags:
    """Per-sync abort flags on a store every trainer rank reaches (torch.distributed's own store of
    the trainer job): nothing new listens, and only the job's ranks can raise or read them."""

    PREFIX = "weightsync/stream-abort/"

    def __init__(self, store):
        self.store = store

    def raise_flag(self, sync_id: str, reason: str) -> None:
        self.store.set(self.PREFIX + sync_id, reason.encode()[:4096])

    def raised(self, sync_id: str) -> str:
        key = self.PREFIX + sync_id
        if not self.store.check([key]):
            return ""
        return self.store.get(key).decode(errors="replace") or "aborted"


class LocalFlags:
    """The same flags within one process (a single-rank trainer, tests)."""

    def __init__(self):
        self._flags: dict[str, str] = {}
        self._lock = threading.Lock()

    def raise_flag(self, sync_id: str, reason: str) -> None:
        with self._lock:
            self._flags.setdefault(sync_id, reason or "aborted")

    def raised(self, sync_id: str) -> str:
        with self._lock:
            return self._flags.get(sync_id, "")
