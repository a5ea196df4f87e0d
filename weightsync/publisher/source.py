"""`WeightSource`: what the publisher exports from, every optional ability declared with its default.

The sync orchestrator, its stream phase and the multi-sender streams ask a source only through
these names, never by probing for an attribute: a source that lacks an ability inherits the
default here, which is what a plain source (export, pack, send) does. trainer-svc's actors
(trainer_svc/actor/base.py `Actor`), the Publisher's declared sources
(weightsync/publisher/declared.py, collective.py) and the tests' stand-ins all derive from it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from weightsync.bus.plan import TensorMeta


@dataclass
class RankSyncState:
    """What the publisher keeps on a sending rank between syncs (multi-sender streams)."""

    #: this rank's part of the delta base (weightsync.publisher.delta_sync.RankPart), or None
    delta_part: Any = None
    #: this rank's NCCL sender groups (weightsync.bus.nccl.sender_groups.SenderGroupCache), or None
    nccl_groups: Any = None


class WeightSource:
    #: the model family key of the rule table, e.g. "qwen2"
    family: str = ""
    #: bumped whenever the weights change; a sync publishes this version
    version: int = 0
    #: how rank 0 tells every sender rank to stop a multi-sender stream (a command channel's
    #: flags: raise_flag(sync_id, reason) / raised(sync_id)); None: a source of one rank
    stream_flags: Any = None
    #: global rank -> the UUID of the GPU it exports on (NCCL takes one rank per GPU); None: unknown
    rank_gpus: list[str] | None = None
    #: what the last export counted (megatron: "forwarded_bytes", the bytes other ranks sent rank 0)
    export_stats: Mapping[str, int] = MappingProxyType({})
    #: `flat_fp8_weights` gives the block-FP8 weights of its flat buckets, so a sync that writes into
    #: the engine can dequantize them from the parameters and leave the FP8 slots unwritten at prepare
    fp8_weights_from_parameters: bool = False
    #: every rank of a multi-sender stream can lay the buckets it owns out in its own storage
    #: (`own_flat_buckets`, `decline_own_flat`); False: every rank exports and packs
    own_flat: bool = False

    # ---- required -----------------------------------------------------------------------
    def export_metas(self) -> list[TensorMeta]:
        """HF name, shape and export dtype of every tensor, in export order."""
        raise NotImplementedError

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) in `export_metas()` order."""
        raise NotImplementedError

    # ---- optional, with the default of a source that lacks the ability -------------------
    @property
    def publishable(self) -> bool:
        """Whether there are tensors to send now (False: a newly registered rollout is not caught up)."""
        return True

    def export_owners(self) -> list[int] | None:
        """The global rank assembling each tensor of `export_metas()` (every owner then streams its
        own: weightsync/publisher/multisender.py, with `run_senders`), or None: rank 0 sends all."""
        return None

    def flat_buckets(self, manifest, quantize: bool = True) -> list[torch.Tensor] | None:
        """The manifest's buckets laid out in the source's own storage (no export, no pack), or None.
        `quantize` False: a block-FP8 layout's FP8 slots are left for `flat_quantize` or the engine writer."""
        return None

    def flat_fp8_weights(self):
        """The FP8 weights of the last `flat_buckets` (see `fp8_weights_from_parameters`), or None."""
        return None

    def flat_quantize(self) -> ValueError | None:
        """The FP8 slots of the last `flat_buckets(quantize=False)` written now; the error naming a
        non-finite weight, or None."""
        return None

    def flat_known_sums(self):
        """The word sums the last `flat_buckets` already has of its buckets, or None (sum them all)."""
        return None

    def own_flat_buckets(self, manifest) -> list[torch.Tensor] | None:
        """A rank of a multi-sender stream: the buckets it owns in its own storage, or None (pack)."""
        return None

    def decline_own_flat(self, manifest) -> None:
        """A rank of a multi-sender stream packs for its own reasons (its group must hear of it)."""

    def rank_sync_state(self) -> RankSyncState:
        """What the publisher keeps on this rank between syncs (created on first use: sources need
        not call this class's __init__)."""
        state = self.__dict__.get("_rank_sync_state")
        if state is None:
            state = self.__dict__["_rank_sync_state"] = RankSyncState()
        return state
