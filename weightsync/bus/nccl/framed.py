"""Framed buckets on a collective group: a bucket goes dense or as a delta, its length told first.

A plain NCCL stream broadcasts each bucket's `nbytes`, which every rank knows from the manifest.
A delta bucket (weightsync/bus/delta/codec.py) has a length only the trainer knows once it has encoded
it, and a broadcast needs the same count on every rank, so in a sync whose trainer offered a delta
base every bucket is two broadcasts: a 32-byte header (index, kind, payload length) and then that
many payload bytes. A broadcast reaches every member alike, so a bucket goes as a delta only when
every member accepted the base (publisher/delta_sync.py); the others' syncs are framed too, with
dense frames. Both ends know whether a sync is framed from PrepareSync alone: the trainer's offer
(`delta_base`), which a rollout answers with `delta_accepted` or a `delta_refusal`. With several
senders each trainer rank frames the buckets it owns on its own group (a group per sender:
sender_groups.py), dense where its part of the base is of no use.

The header costs one small broadcast and, on the receiver, one device-to-host read per bucket
before the payload's receive can be posted: a few tens of microseconds, next to the milliseconds a
bucket takes on a link that a delta pays off on (a slow one between hosts). Each send waits for its
broadcasts, so a framed stream does not overlap buckets as the plain one does. Under
`sync_encoding=auto` nothing is framed until a full sync measured the link below `delta_link_gbps`
(NVLink never is: publisher/delta_sync.py).

The group is anything with `broadcast(buf, timeout)` from rank 0 (NcclGroup; the CPU stand-ins of
the tests) and a `device`.
"""

from __future__ import annotations

import struct

import torch

from weightsync.bus.channel import BucketReceiver, BucketSender
from weightsync.bus.errors import TransportError
from weightsync.bus.plan import BucketPlan

FRAME_MAGIC = 0x31465357  # "WSF1"
DENSE, DELTA = 0, 1
_HDR = struct.Struct("<IIIIQQ")  # magic, index, kind, reserved, payload length, dense nbytes
HEADER_BYTES = _HDR.size


def _device(group) -> torch.device:
    return torch.device(getattr(group, "device", None) or "cpu")


class FramedSender(BucketSender):
    """Rank 0's end: `send(plan, buf, checksum, delta=payload)` broadcasts the delta frame, else the
    dense one. Each send returns once its broadcasts completed (the buffer may then be reused)."""

    checksums_in_band = "none"  # as the plain stream: the receivers checksum what arrived

    def __init__(self, group):
        if group.rank != 0:
            raise ValueError("the bus sender must be rank 0 of its NCCL group")
        self.group = group
        self.device = _device(group)
        self.wire_bytes_sent = 0  # header and payload bytes broadcast

    def send(
        self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None, delta: torch.Tensor | None = None
    ) -> None:
        if delta is not None and delta.numel() >= plan.nbytes:
            raise ValueError(f"bucket {plan.index}: a delta of {delta.numel()} bytes is no smaller than the bucket")
        body = buf[: plan.nbytes] if delta is None else delta
        kind = DENSE if delta is None else DELTA
        head = torch.frombuffer(
            bytearray(_HDR.pack(FRAME_MAGIC, plan.index, kind, 0, body.numel(), plan.nbytes)), dtype=torch.uint8
        )
        self.group.broadcast(head.to(self.device))
        body = body if body.device == self.device and body.is_contiguous() else body.to(self.device).contiguous()
        self.group.broadcast(body)
        self.wire_bytes_sent += HEADER_BYTES + body.numel()

    def failures(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass


class FramedReceiver(BucketReceiver):
    """A rollout's end of a framed stream. `base`: the rollout's delta base writer for this sync
    (rollout_svc/sync/delta_base.py: `received` keeps a dense bucket, `patched` applies a delta onto
    the kept copy; each returns the resulting bucket), or None: dense frames only."""

    def __init__(self, group, buckets: list[BucketPlan], base=None):
        self.group, self.base = group, base
        self.device = _device(group)
        size = max((b.nbytes for b in buckets), default=0)
        self._buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)

    def recv(self, plan: BucketPlan, timeout: float) -> tuple[torch.Tensor, int | None]:
        self.group.broadcast(self._head, timeout)
        magic, index, kind, _, length, nbytes = _HDR.unpack(bytes(self._head.cpu().numpy()))
        if magic != FRAME_MAGIC or kind not in (DENSE, DELTA):
            raise TransportError(f"bucket {plan.index}: bad frame header (magic {magic:#x}, kind {kind})")
        if index != plan.index or nbytes != plan.nbytes:
            raise TransportError(
                f"frame says bucket {index} with {nbytes} bytes; manifest expects bucket {plan.index} "
                f"with {plan.nbytes} bytes"
            )
        # the manifest bounds what a frame makes us receive: a delta is smaller than its bucket
        if (kind == DENSE and length != nbytes) or (kind == DELTA and length >= nbytes):
            raise TransportError(f"bucket {plan.index}: a {'delta' if kind else 'dense'} frame of {length} bytes")
        if kind == DELTA and self.base is None:
            # every rank must still take the payload's broadcast, or the group hangs: receive it, then refuse
            self.group.broadcast(self._buf[:length], timeout)
            raise TransportError(f"bucket {plan.index}: a delta frame, but this rollout keeps no delta base")
        view = self._buf[:length]
        self.group.broadcast(view, timeout)
        if kind == DELTA:
            return self.base.patched(plan, view), None
        if self.base is not None:
            return self.base.received(plan, view), None
        return view, None

    def close(self) -> None:
        pass
