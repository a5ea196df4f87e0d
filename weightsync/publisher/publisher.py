"""`Publisher`: the trainer side of weightsync as a library, for a training loop this project does not own.

    pub = Publisher("/models/Qwen2.5-7B", grpc_address="0.0.0.0:50051", auth=Auth(token_file="/run/token"))
    pub.start()                              # rollouts started with --trainer-address HOST:50051 register
    report = pub.sync(model.named_parameters())   # HF names, HF layout; returns once committed
    pub.close()

It serves what trainer-svc serves to its rollouts, from the same code (weightsync/publisher/host.py):
the Trainer gRPC service (RegisterRollout, DeregisterRollout, GetStatus, Sync), HTTP /healthz,
/readyz, /metrics and /v1/status, /v1/sync; the same bus, transactions, checksums, sync link and
security defaults (a non-loopback address needs a token, or insecure=True).

Every `sync()` publishes a new version (1, 2, ...) to every registered rollout. It holds no
reference to the tensors once it returns, unless `snapshot=True` (then it keeps a copy, and a
rollout that registers between two syncs is caught up from it at once): with snapshot=False a
newly registered rollout is brought up to date by the next `sync()`.
A distributed trainer passes `group=` (a torch.distributed group): every rank of it builds the
Publisher and calls `sync()` with the tensors it owns; each owner streams its own buckets and the
group's rank 0 serves the control plane (collective.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from weightsync.bus.transports import multi_sender_names
from weightsync.bus.transports import transport as transport_named
from weightsync.control.auth import load_token
from weightsync.publisher.collective import GroupSource, agree_on_owners, expect, send_done, serve_senders
from weightsync.publisher.commands import CommandChannel
from weightsync.publisher.declared import DeclaredModel, DeclaredSource
from weightsync.publisher.host import PublisherHost
from weightsync.publisher.resume import resume_version
from weightsync.sync_options import DEFAULTS, SyncOptions
from weightsync.v1 import trainer_pb2

log = logging.getLogger(__name__)
#: transport="auto": the trainer's default (tcp works across hosts and devices; ask for nccl or ipc by name)
AUTO_TRANSPORT = "tcp"


class SyncFailed(RuntimeError):
    """A rollout did not commit the version; `report` says which and why (each rollout still serves a
    complete version: the new one where it committed, its previous one elsewhere)."""

    def __init__(self, report: trainer_pb2.SyncReport):
        self.report = report
        failed = [f"{r.rollout_id}: {r.error}" for r in report.rollouts if not r.ok]
        super().__init__(f"sync of version {report.version} failed on {len(failed)} rollout(s): " + "; ".join(failed))


@dataclass(frozen=True)
class Auth:
    """The control plane's token: `token` or the file holding it (`token_file`), never both; a
    non-loopback address needs one, or `insecure=True`."""

    token: str = ""
    token_file: str = ""
    insecure: bool = False


class Publisher:
    def __init__(
        self,
        model,
        *,
        grpc_address: str = "127.0.0.1:50051",
        http_address: str = "127.0.0.1:8081",
        auth: Auth = Auth(),
        options: SyncOptions = DEFAULTS,
        group=None,
        snapshot: bool = False,
        trainer_id: str = "",
    ):
        """`model`: an HF model directory (its config.json), a transformers config, or a dict
        {HF name: (shape, dtype)}; `DeclaredModel(model, dtype=, family=)` says how its tensors are
        given (default the config's torch_dtype, else float32) and the rollouts' model family (default
        from the HF config; a rollout of another family is refused at registration).
        `options`: how it syncs (weightsync/sync_options.py: transport, bucket_bytes, timeouts,
        `device` where the tensors live, `export_dtype` e.g. fp8-block, `sync_encoding`: auto sends a
        rollout that holds the last version only the values that changed, over tcp, at the cost of a
        host copy of the last version's export (at most `delta_base_bytes`; a larger model is synced in
        full; with a group, each rank keeps its own tensors' share), and over nccl once a full sync
        measured the link below `delta_link_gbps`; full keeps no copy; delta as auto on every tcp or
        nccl link: docs/architecture.md "Delta syncs"). `group`: a torch.distributed group whose every
        rank builds this Publisher (collective) and calls sync() with the tensors it owns; its rank 0
        serves the control plane (the addresses and the token are read there only), the others only
        send; None: this process alone. `snapshot`: keep a copy of each sync's tensors, so a rollout
        that registers between two syncs is caught up at once.
        Raises ValueError for a bad option, ConfigError for an exposed address without a token."""
        if auth.token and auth.token_file:
            raise ValueError("Auth: set token or token_file, not both")
        declared = model if isinstance(model, DeclaredModel) else DeclaredModel(model)
        channel = _group_channel(group, options.sync_timeout_s, options.transport, snapshot)
        #: this process's rank in `group` (0 without one): rank 0 serves, every rank sends
        self.rank = 0 if channel is None else channel.rank
        token = load_token(auth.token, auth.token_file) if self.rank == 0 else ""
        metas, fam = declared.metas()
        device = torch.device(options.device)
        if channel is None:
            self.source = DeclaredSource(metas, fam, device)
        else:
            self.source = GroupSource(metas, fam, device, channel)
            self.source.rank_gpus = _gpus_of(channel, self.source.device)
        self.snapshot = snapshot
        self.group = channel
        self._started = False
        self._closed = False
        #: the control plane, on rank 0 only
        self.host: PublisherHost | None = None
        if self.rank != 0:
            return
        self.host = PublisherHost(
            grpc_address=grpc_address,
            http_address=http_address,
            token=token,
            insecure=auth.insecure,
            prog="publisher",
            trainer_id=trainer_id,
            rpc_timeout_s=options.rpc_timeout_s,
        )
        # a catch-up needs tensors to send: only a snapshot has them outside sync()
        self.host.publish(self.source, self.source.lock, options=options, backend="external", auto_sync=snapshot)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Publisher:
        if self._closed:
            raise RuntimeError("this Publisher is closed; create a new one")
        self._started = True
        if self.host is None:
            return self
        self.host.start()
        log.info(
            "publisher %s serving: grpc %s, http :%d, %d tensors, family %s",
            self.trainer_id,
            self.address,
            self.http_port,
            len(self.source.export_metas()),
            self.source.family or "-",
        )
        return self

    def close(self) -> None:
        """Stop serving and release the ports (also for a publisher never started); idempotent."""
        if not self._closed and self.host is not None:
            self.host.stop()
        self._closed = True
        self._started = False
        self.source.hold(None)

    def __enter__(self) -> Publisher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- facts ----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The gRPC host:port rollouts reach (`rollout-svc --trainer-address`); rank 0 of a group only."""
        return self._control("address").grpc.address

    @property
    def http_port(self) -> int:
        return self._control("http_port").http.port

    @property
    def version(self) -> int:
        """The version of the last sync() (0 before the first)."""
        return self.source.version

    @property
    def trainer_id(self) -> str:
        return self._control("trainer_id").trainer_id

    def rollouts(self) -> list[str]:
        """The ids of the registered rollouts (rank 0 of a group only)."""
        return [e.rollout_id for e in self._control("rollouts").registry.all()]

    def wait_for_rollouts(self, n: int, timeout: float = 120.0) -> list[str]:
        """Block until at least `n` rollouts have registered; TimeoutError naming how many did.
        Collective with a group: rank 0 waits and every rank returns its answer (or raises its error)."""
        if self.group is None:
            return self._wait_for_rollouts(n, timeout)
        if self.rank != 0:
            got = expect(self.group, "rollouts")
            if got["error"]:
                raise TimeoutError(got["error"])
            return got["ids"]
        try:
            ids = self._wait_for_rollouts(n, timeout)
        except TimeoutError as exc:
            self.group.send("rollouts", ids=[], error=str(exc))
            raise
        self.group.send("rollouts", ids=ids, error="")
        return ids

    def _wait_for_rollouts(self, n: int, timeout: float) -> list[str]:
        import time

        deadline = time.monotonic() + timeout
        while len(ids := self.rollouts()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(ids)} of {n} rollout(s) registered within {timeout}s; start them with "
                    f"--trainer-address {self.address} (and this publisher's token)"
                )
            time.sleep(0.1)
        return ids

    # ---- publishing -----------------------------------------------------------------------
    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        transport: str = "",
        timeout_s: float = 0.0,
        raise_on_failure: bool = True,
    ) -> trainer_pb2.SyncReport:
        """Publish `named_tensors` ((HF name, tensor) in HF layout, every declared tensor once) as the
        next version to every registered rollout, and return the SyncReport once they committed.

        Raises ValueError/TypeError naming the tensor that does not match the declaration (before
        anything is sent; the version is not bumped), and SyncFailed (with `.report`) when a rollout
        did not commit, unless raise_on_failure=False (then check `report.ok`). With no rollout
        registered the report has ok=False and no rollouts, and nothing is raised: the loop goes on.

        With `group=`: every rank calls it with the tensors it owns (each declared tensor given by
        exactly one rank; otherwise the same ValueError, naming the tensor, on every rank) and every
        rank returns the same report (or raises the same SyncFailed); ranks other than 0 wait for
        rank 0 at most 2 * sync_timeout_s + 60 s."""
        if not self._started:
            raise RuntimeError("Publisher.sync() before start()")
        transport = AUTO_TRANSPORT if transport == "auto" else transport
        if self.group is not None:
            return self._sync_group(named_tensors, transport, timeout_s, raise_on_failure)
        tensors = self.source.check(named_tensors)
        if self.snapshot:
            tensors = {n: t.clone() for n, t in tensors.items()}
        orch = self.host.orch
        # the new version and its tensors change together: a catch-up sync running now exports the old pair
        if not self.source.lock.acquire(timeout=orch.sync_timeout):
            raise TimeoutError(f"a sync still ran after {orch.sync_timeout}s (sync_timeout_s)")
        try:
            # a restarted publisher continues its trainer id's version line (resume.py)
            self.source.version = resume_version(self.source.version, self.host.registry.all(), orch.trainer_id) + 1
            self.source.hold(tensors)
        finally:
            self.source.lock.release()
        try:
            report = orch.sync(self.host.registry.all(), transport, timeout_s, wait_s=orch.sync_timeout)
        finally:
            if not self.snapshot:
                self.source.hold(None)  # the caller's tensors change after this returns: never send them later
        if not report.rollouts:
            log.warning("sync of version %d: no rollout registered", report.version)
        elif not report.ok and raise_on_failure:
            raise SyncFailed(report)
        return report

    def _sync_group(self, named_tensors, transport: str, timeout_s: float, raise_on_failure: bool):
        """sync() on every rank of a group (collective.py): the report on every rank."""
        if transport and self.group.group is not None:
            _check_multi_sender(transport)
        source = self.source
        tensors = agree_on_owners(source, named_tensors)
        if self.rank != 0:
            source.version += 1
            source.hold(tensors)
            try:
                report = serve_senders(source)
            finally:
                source.hold(None)
        else:
            report = self._lead_group_sync(tensors, transport, timeout_s)
        if report.rollouts and not report.ok and raise_on_failure:
            raise SyncFailed(report)
        return report

    def _lead_group_sync(self, tensors, transport: str, timeout_s: float) -> trainer_pb2.SyncReport:
        """Rank 0 of a group: the orchestrator's sync, every rank streaming its own; the report goes to every rank."""
        import threading

        source, orch = self.source, self.host.orch
        report, error = None, ""
        try:
            if not source.lock.acquire(timeout=orch.sync_timeout):
                raise TimeoutError(f"a sync still ran after {orch.sync_timeout}s (sync_timeout_s)")
            try:
                source.version += 1
                source.hold(tensors)
            finally:
                source.lock.release()
            source._sync_thread = threading.get_ident()
            report = orch.sync(self.host.registry.all(), transport, timeout_s, wait_s=orch.sync_timeout)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            source._sync_thread = None
            source.hold(None)
            send_done(source, report, error)
        if not report.rollouts:
            log.warning("sync of version %d: no rollout registered", report.version)
        return report

    def _control(self, what: str) -> PublisherHost:
        if self.host is None:
            raise RuntimeError(f"Publisher.{what}: rank {self.rank} of the group only sends; rank 0 serves rollouts")
        return self.host


def _check_multi_sender(transport: str) -> None:
    if not transport_named(transport).multi_sender:
        multi = " or ".join(multi_sender_names())
        raise ValueError(
            f"transport={transport!r} streams from one process; a Publisher over a group of several ranks "
            f"streams from every owner: use {multi}"
        )


def _group_channel(group, sync_timeout_s: float, transport: str, snapshot: bool):
    """The command channel over `group`'s ranks (collective: every rank builds it), or None without a group."""
    if group is None:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("group=: torch.distributed is not initialised (call init_process_group first)")
    if dist.get_world_size(group) > 1:
        _check_multi_sender(transport)
        if snapshot:
            raise ValueError(
                "snapshot=True with a group of several ranks: every rank's share would be kept and a "
                "catch-up would need every rank outside sync(); leave snapshot off (the next sync catches up)"
            )
    # one sync may wait for another (a wsctl sync) for sync_timeout_s, then run for as long
    wait = timedelta(seconds=2 * sync_timeout_s + 60)
    return CommandChannel(group, command_timeout=wait, result_timeout=wait)


def _gpus_of(channel, device: torch.device) -> list[str]:
    """Group rank -> the UUID of the GPU it exports from (NCCL takes one rank per GPU); [] on CPU.
    Collective: every rank passes the same device type."""
    if device.type != "cuda":
        return []
    from weightsync.bus.gpu import uuid_of

    index = device.index if device.index is not None else torch.cuda.current_device()
    gathered = channel.gather({"gpu": uuid_of(torch.device("cuda", index))})
    return [g["gpu"] for g in gathered] if gathered else []
