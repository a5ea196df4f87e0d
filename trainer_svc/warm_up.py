"""Warm a torchrun worker's kernels: a rank that streams its own buckets compiles what it will run.

The rank-0 warm-up is the publisher's (weightsync/publisher/warm_up.py).
"""

from __future__ import annotations

from weightsync.publisher.warm_up import warm_up


def warm_up_sender(actor, cfg) -> None:
    """A torchrun worker that streams its own buckets (`--senders all`): warm what it will run."""
    from weightsync.publisher.export_format import export_format
    from weightsync.publisher.multisender import export_device

    if cfg.bus.senders != "all":
        return  # the funnel: rank 0 packs, checksums and quantizes everything
    owners, rank = actor.export_owners(), actor.rank
    mine = [m for m, o in zip(actor.export_metas(), owners) if o == rank]
    if mine:
        warm_up(
            export_device(actor),
            mine,
            export_format(cfg.actor.export_dtype).quantization is not None,
            who=f"rank {rank}",
        )
