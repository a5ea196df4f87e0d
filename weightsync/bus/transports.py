"""The transports, by name: where each one's ends live and what it can do, declared in one place.

Everything that names a transport — the CLI's and the config's choices, the trainer's request
validation, the orchestrator's senders, the rollout's PrepareSync — takes it from `TRANSPORTS`,
so adding one is its own package under weightsync/bus/<name>/ and one line here
(docs/architecture.md, "Adding a transport").

Importing this module is cheap (no torch): the ends are named as "module:Class" and imported
when a service builds them, so wsctl can list the choices without loading a tensor library.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Transport:
    name: str
    #: "module:Class" of the trainer's end (a weightsync.bus.session.Sender), built once per trainer
    #: with `Class.for_trainer(TrainerSide)`
    trainer_end: str
    #: "module:Class" of the rollout's end (a weightsync.bus.rollout_end.RolloutEnd), built once per
    #: rollout with `Class.for_rollout(RolloutSide)`
    rollout_end: str
    #: "module:Class" of the channel that moves the buckets (a weightsync.bus.channel.BucketSender)
    channel: str
    #: one line for help texts: where it runs
    summary: str
    #: several trainer ranks may each stream the buckets they own (senders=all)
    multi_sender: bool
    #: the rollout may take the commit on the stream that carried the buckets (PrepareSyncResponse.commit_on_stream)
    commit_on_stream: bool
    #: which buckets' checksums the channel sends with the bucket, by default: "all", "first" or "none"
    #: (the others go with the commit)
    checksums_in_band: str
    #: `send(k)` only frees bucket k-1's buffer; `flush()` waits for the rest
    releases_previous: bool
    #: each member of a group takes a GPU of its own (NCCL): a rollout on a sending rank's GPU is
    #: streamed to from global rank 0 alone
    one_rank_per_gpu: bool = False
    #: who writes the bucket bytes into the engine, when the transport lets a sync choose
    #: (`ipc_direction`): these name a sync's route in place of single / multi-sender
    #: (weightsync/publisher/route.py); () for a transport whose rollout always receives
    writers: tuple[str, ...] = ()

    def trainer_end_class(self) -> type:
        return _load(self.trainer_end)

    def rollout_end_class(self) -> type:
        return _load(self.rollout_end)

    def channel_class(self) -> type:
        return _load(self.channel)


TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            "tcp",
            "weightsync.bus.tcp.sender:TcpSender",
            "weightsync.bus.tcp.receiver:TcpRolloutEnd",
            "weightsync.bus.tcp.wire:TcpBucketSender",
            "any host",
            multi_sender=True,
            commit_on_stream=False,
            checksums_in_band="all",
            releases_previous=False,
        ),
        Transport(
            "nccl",
            "weightsync.bus.nccl.sender:NcclSender",
            "weightsync.bus.nccl.receiver:NcclReceiver",
            "weightsync.bus.nccl.group:NcclBucketSender",
            "trainer and rollouts on GPUs",
            multi_sender=True,
            commit_on_stream=False,
            checksums_in_band="none",
            releases_previous=True,
            one_rank_per_gpu=True,
        ),
        Transport(
            "ipc",
            "weightsync.bus.ipc.sender:IpcSender",
            "weightsync.bus.ipc.receiver:IpcReceiver",
            "weightsync.bus.ipc.sender:IpcStreamSender",
            "rollouts on the trainer's own GPU",
            multi_sender=False,
            commit_on_stream=True,
            checksums_in_band="all",
            releases_previous=True,
            writers=("rollout_reads", "trainer_writes"),
        ),
    )
}

#: the transport names, in the order help texts list them
NAMES: tuple[str, ...] = tuple(TRANSPORTS)


def transport(name: str, field_name: str = "transport") -> Transport:
    """The transport called `name`; ValueError naming `field_name` and the choices otherwise."""
    t = TRANSPORTS.get(name)
    if t is None:
        raise ValueError(f"{field_name}={name!r} must be {choices()}")
    return t


def choices(names=NAMES) -> str:
    """ "tcp, nccl or ipc": the names as a sentence lists them."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def multi_sender_names() -> tuple[str, ...]:
    return tuple(t.name for t in TRANSPORTS.values() if t.multi_sender)


def single_sender_names() -> tuple[str, ...]:
    return tuple(t.name for t in TRANSPORTS.values() if not t.multi_sender)


def summary() -> str:
    """ "tcp (any host), nccl (…), ipc (…)": each transport with where it runs, for help texts."""
    return ", ".join(f"{t.name} ({t.summary})" for t in TRANSPORTS.values())


@dataclass
class TrainerSide:
    """What a trainer's end is built from (`Class.for_trainer`): the trainer's own pieces."""

    token: str
    #: where the trainer's export lives (torch.device)
    device: object
    #: weightsync.bus.session.RpcCall: a unary call to a rollout (over its sync link or gRPC)
    call: object = None
    #: a streaming call to a rollout: (entry, method, request iterator, timeout) -> response iterator
    open_stream: object = None
    #: transport name -> keyword arguments only that transport's end takes (a test's NCCL bus, its timeouts)
    options: dict[str, dict] = field(default_factory=dict)


@dataclass
class RolloutSide:
    """What a rollout's end is built from (`Class.for_rollout`): the rollout's own pieces."""

    #: the sync transaction its buckets feed (rollout_svc.sync.transaction.SyncTransaction)
    tx: object
    #: the engine's device (torch.device or None)
    device: object
    engine_name: str
    #: host:port of the rollout's TCP bus listener, as the trainer should dial it
    data_address: str = ""
    #: bus connections the TCP listener takes at once (one per sender)
    max_connections: int = 8
    #: transport name -> keyword arguments only that transport's end takes (metrics hooks)
    options: dict[str, dict] = field(default_factory=dict)


def _load(ref: str) -> type:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
