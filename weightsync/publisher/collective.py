"""A Publisher over a torch.distributed group: every rank publishes the HF tensors it owns.

Every rank of the group builds the `Publisher` (with `group=`) and calls `sync(named_tensors)`
with its share: the HF-named tensors it owns, already gathered over TP/PP/EP (for megatron-core,
trainer_svc.actor.megatron.hf_tensors does that with this project's rules). The group's rank 0 runs
the control plane (gRPC registry, orchestrator, HTTP); the other ranks bind nothing and only send.

One sync, on every rank:

1. each rank checks its share against the declared model (names, shapes, dtypes, device) and
   hands rank 0 its names, the digest of its declaration and its error if any;
2. rank 0 rules (`rule_owners`): same declaration everywhere, every declared tensor owned by
   exactly one rank; it broadcasts the owners, or the error naming the tensor, which every rank raises;
3. rank 0 runs the orchestrator's sync; its stream phase hands every rank a `SendJob` and each
   owner streams its own buckets (multisender.py: the code trainer-svc's megatron ranks run);
4. rank 0 broadcasts the report: every rank returns it, or raises the same `SyncFailed`.

Every wait is bounded: the group's command channel (commands.py, its own gloo groups) times out
after `2 * sync_timeout_s + 60` seconds (one sync may wait for another to finish, then run).
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from dataclasses import asdict

import torch

from weightsync.bus.plan import TensorMeta
from weightsync.publisher.declared import DeclaredSource
from weightsync.publisher.multisender import SendJob, run_sender
from weightsync.v1 import trainer_pb2


class GroupSource(DeclaredSource):
    """The orchestrator's actor on every rank of a collective Publisher: this rank's share of the
    sync at hand, and the owner of every declared tensor as rank 0 ruled for it."""

    def __init__(self, metas: list[TensorMeta], family: str, device: torch.device, channel):
        super().__init__(metas, family, device)
        self.channel = channel
        self.rank = channel.rank
        #: rank 0 raises a sync's flag to end every rank's NCCL broadcasts (multisender.py)
        self.stream_flags = channel.flags
        #: group rank -> UUID of the GPU it exports on ("" on CPU), set by the Publisher (nccl)
        self.rank_gpus: list[str] = []
        self._owners: list[int] = [0] * len(metas)
        #: the thread of the collective sync in progress on rank 0: only it may start the senders
        self._sync_thread: int | None = None

    # ---- the multi-sender actor contract (multisender.py) -------------------------------
    def export_owners(self) -> list[int]:
        return list(self._owners)

    def export_own_tensors(self, stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        held = self._held()
        for m, owner in zip(self._metas, self._owners):
            if owner == self.rank:
                yield m.name, held[m.name]

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0 streaming alone: only when it owns every tensor (the others never send it theirs)."""
        others = sorted({o for o in self._owners if o != 0})
        if others:
            raise RuntimeError(
                f"ranks {others} own tensors of this sync: a group Publisher streams from every owner "
                "(transport tcp or nccl), never through rank 0"
            )
        return super().export_tensors()

    def run_senders(self, job: dict) -> list[dict]:
        """Rank 0: every rank streams the buckets it owns; their reports, in rank order."""
        if self._sync_thread != threading.get_ident():
            # the other ranks only listen inside Publisher.sync(): a sync started elsewhere (wsctl
            # sync, the Sync RPC) would wait for them in vain
            raise RuntimeError(
                "a group Publisher streams only inside Publisher.sync(), which every rank calls; "
                "this sync was started elsewhere (wsctl sync / the Sync RPC)"
            )
        self.channel.send("stream", **job)
        return self.channel.gather(asdict(run_sender(self, SendJob.from_args(job))))

    def parameters(self) -> list[torch.Tensor]:
        """Where this rank's share lives (multisender.export_device reads the first)."""
        held = self._tensors or {}
        return list(held.values())[:1]

    def _held(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            raise RuntimeError("a group Publisher holds tensors only inside Publisher.sync()")
        return self._tensors


def rule_owners(metas: list[TensorMeta], shares: list[dict]) -> list[int] | str:
    """Rank 0: each declared tensor's owner rank from every rank's share
    ({"names": [...], "declared": digest, "error": ""}), or the error every rank raises."""
    errors = [s["error"] for s in shares if s["error"]]
    if errors:
        return "; ".join(errors)
    for rank, s in enumerate(shares):
        if s["declared"] != shares[0]["declared"]:
            return (
                f"rank {rank} declared another model than rank 0 (declaration digest {s['declared']} != "
                f"{shares[0]['declared']}): every rank passes the same model= and dtype="
            )
    owner: dict[str, int] = {}
    for rank, s in enumerate(shares):
        for name in s["names"]:
            if name in owner:
                return f"{name}: given by rank {owner[name]} and rank {rank}; each tensor has exactly one owner rank"
            owner[name] = rank
    missing = [m.name for m in metas if m.name not in owner]
    if missing:
        return (
            f"{missing[0]}: given by no rank ({len(missing)} missing); every sync publishes every declared "
            "tensor, each from the one rank that owns it"
        )
    return [owner[m.name] for m in metas]


def agree_on_owners(source: GroupSource, named_tensors) -> dict[str, torch.Tensor]:
    """Every rank: check this rank's share, and take rank 0's ruling on who owns what.
    Raises the same ValueError on every rank when a share is wrong; a rank whose own iterable
    failed (any exception: the ranks must stay in step) raises that one, chained."""
    failure: Exception | None = None
    try:
        mine, error = source.check(named_tensors, complete=False), ""
    except Exception as exc:
        failure, mine = exc, {}
        error = (
            f"rank {source.rank}: {exc}"
            if isinstance(exc, (ValueError, TypeError))
            else (f"rank {source.rank}: its tensors failed: {type(exc).__name__}: {exc}")
        )
    shares = source.channel.gather({"names": list(mine), "declared": source.digest(), "error": error})
    if source.rank == 0:
        ruling = rule_owners(source.export_metas(), shares)
        verdict = {"error": ruling} if isinstance(ruling, str) else {"owners": ruling, "error": ""}
        source.channel.send("owners", **verdict)
    else:
        verdict = expect(source.channel, "owners")
    if verdict["error"]:
        raise ValueError(verdict["error"]) from failure
    source._owners = [int(o) for o in verdict["owners"]]
    return mine


def expect(channel, op: str) -> dict:
    """A rank other than 0: the next command, which must be `op`."""
    got, args = channel.receive()
    if got != op:
        raise RuntimeError(f"rank {channel.rank} expected {op!r} from rank 0, got {got!r}: the ranks are out of step")
    return args


def serve_senders(source: GroupSource) -> trainer_pb2.SyncReport:
    """A rank other than 0 inside sync(): stream whenever rank 0's orchestrator asks, until it
    sends the report."""
    while True:
        op, args = source.channel.receive()
        if op == "stream":
            source.channel.gather(asdict(run_sender(source, SendJob.from_args(args))))
        elif op == "done":
            if args["error"]:
                raise RuntimeError(f"the sync failed on rank 0: {args['error']}")
            return trainer_pb2.SyncReport.FromString(base64.b64decode(args["report"]))
        else:
            raise RuntimeError(f"rank {source.rank} got {op!r} from rank 0 inside a sync: the ranks are out of step")


def send_done(source: GroupSource, report: trainer_pb2.SyncReport | None, error: str) -> None:
    """Rank 0: end every rank's serve_senders with the report (or the error that ended the sync)."""
    encoded = base64.b64encode(report.SerializeToString()).decode() if report is not None else ""
    source.channel.send("done", report=encoded, error=error)
