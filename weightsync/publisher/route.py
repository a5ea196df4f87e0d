"""The route a sync takes: picked once per sync attempt, named, and dispatched on.

A route is four words, always all four, joined by "/":

    <transport>/<shape>/<payload>/<encoding>

- transport: a name of weightsync.bus.transports (tcp, nccl, ipc).
- shape: who moves the bytes. A transport whose sync chooses who writes into the engine
  (`Transport.writers`, ipc) names it: `trainer_writes` or `rollout_reads`; any other transport
  names its senders: `single` (global rank 0) or `multi-sender` (every owner rank, only where
  `Transport.multi_sender`).
- payload: what the buckets hold: `fp8-block` (a quantized export format, by its name), else the
  exported tensors' dtype when they share one (`bf16`, `fp16`, `fp32`), `mixed` when they do not,
  `other` for any other single dtype.
- encoding: `full` (dense buckets to every target), `delta` (every target took deltas) or `mixed`
  (some did: tcp only; a broadcast reaches every member alike, so nccl is delta for all or none).

The words of each position are disjoint sets, so a string parses back to one route (`Route.parse`),
and the set of routes is small and closed: it labels the trainer's sync metrics
(`weightsync_sync_duration_seconds{route}`, `weightsync_sync_phase_seconds{route}`). The table
of routes and how the stream dispatches on them is in docs/architecture.md ("Routes").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.bus.transports import TRANSPORTS, choices
from weightsync.publisher.delta_sync import DELTA_TRANSPORTS

SINGLE, MULTI_SENDER = "single", "multi-sender"
TRAINER_WRITES, ROLLOUT_READS = "trainer_writes", "rollout_reads"
SENDER_SHAPES = (SINGLE, MULTI_SENDER)
#: payload words of a plain export, by dtype
DTYPE_PAYLOADS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
QUANTIZED_PAYLOADS = ("fp8-block",)
PAYLOADS = (*DTYPE_PAYLOADS.values(), *QUANTIZED_PAYLOADS, "mixed", "other")
FULL, DELTA, MIXED = "full", "delta", "mixed"
ENCODINGS = (FULL, DELTA, MIXED)


@dataclass(frozen=True)
class Route:
    transport: str
    shape: str
    payload: str
    encoding: str

    def __post_init__(self) -> None:
        why = self._invalid()
        if why:
            raise ValueError(f"route {'/'.join(self._words())}: {why}")

    def _words(self) -> tuple[str, str, str, str]:
        return self.transport, self.shape, self.payload, self.encoding

    def _invalid(self) -> str:
        t = TRANSPORTS.get(self.transport)
        if t is None:
            return f"transport {self.transport!r} must be {choices()}"
        shapes = t.writers or (SENDER_SHAPES if t.multi_sender else (SINGLE,))
        if self.shape not in shapes:
            return f"shape {self.shape!r} must be {choices(shapes)} over {self.transport}"
        if self.payload not in PAYLOADS:
            return f"payload {self.payload!r} must be {choices(PAYLOADS)}"
        if self.encoding not in ENCODINGS:
            return f"encoding {self.encoding!r} must be {choices(ENCODINGS)}"
        if self.encoding != FULL and self.transport not in DELTA_TRANSPORTS:
            return f"encoding {self.encoding} needs transport {choices(DELTA_TRANSPORTS)} (deltas go over those only)"
        if self.encoding == MIXED and self.transport == "nccl":
            return "encoding mixed over nccl: a broadcast reaches every member alike (delta for all or none)"
        return ""

    def __str__(self) -> str:
        return "/".join(self._words())

    @classmethod
    def parse(cls, text: str) -> Route:
        """The route `str(route)` names; ValueError naming what is wrong with `text`."""
        words = text.split("/")
        if len(words) != 4:
            raise ValueError(f"route {text!r} must be <transport>/<shape>/<payload>/<encoding>")
        return cls(*words)

    @property
    def multi_sender(self) -> bool:
        """Every owner rank streams its own buckets (weightsync/publisher/multisender.py)."""
        return self.shape == MULTI_SENDER

    @property
    def trainer_writes(self) -> bool:
        """The trainer writes the buckets into the engine itself, summing as it writes (ipc)."""
        return self.shape == TRAINER_WRITES


def payload_of(manifest, format_name: str) -> str:
    """The payload word of a sync of `manifest`: its quantized format's name, or its tensors' dtype."""
    if manifest.quantization is not None:
        return format_name if format_name in QUANTIZED_PAYLOADS else "other"
    dtypes = {m.dtype for m in manifest.metas()}
    if len(dtypes) > 1:
        return "mixed"
    return DTYPE_PAYLOADS.get(next(iter(dtypes)), "other") if dtypes else "other"


def encoding_of(prepared, accepted) -> str:
    """full, delta or mixed: which of the `prepared` targets take this sync's deltas (`accepted`)."""
    taking = set(prepared) & set(accepted)
    if not taking:
        return FULL
    return DELTA if taking == set(prepared) else MIXED


def pick(session, manifest, format_name: str, prepared, accepted) -> Route:
    """This attempt's route, from what the session and the manifest declare once prepare answered:
    the transport (`session.name`), who writes (`session.direction`, for a transport with writers),
    the senders (`manifest.senders`), the payload and the encoding."""
    t = TRANSPORTS[session.name]
    if t.writers:
        shape = session.direction
    else:
        shape = MULTI_SENDER if len(manifest.senders) > 1 else SINGLE
    return Route(session.name, shape, payload_of(manifest, format_name), encoding_of(prepared, accepted))


def all_routes() -> list[Route]:
    """Every valid route: the closed set the metrics' `route` label takes (docs/architecture.md)."""
    out = []
    for t in TRANSPORTS.values():
        for shape in t.writers or SENDER_SHAPES:
            for payload in PAYLOADS:
                for enc in ENCODINGS:
                    try:
                        out.append(Route(t.name, shape, payload, enc))
                    except ValueError:
                        continue  # not a combination a sync can take
    return out
