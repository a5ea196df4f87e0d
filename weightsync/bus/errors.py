"""The two ways a sync fails on the weight bus.

TransportError: moving bytes failed (peer gone, timeout, corrupt frame); raised by channels.
CorruptFrame: the TransportError of a frame whose content is damaged (DATA_LOSS, not UNAVAILABLE).
SyncError: a rollout cannot take part in a sync (bad request, wrong GPU, no such group); its
`code` names the gRPC status the rollout answers with.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """Moving bytes failed (peer gone, timeout, corrupt frame). The sync must abort."""


class CorruptFrame(TransportError):
    """A frame arrived whole but its content cannot be what a sender wrote (a delta's header, length or
    positions do not fit): corruption in flight, reported DATA_LOSS like a checksum mismatch."""

    code = "DATA_LOSS"


class SyncError(RuntimeError):
    """The sync cannot proceed; `code` maps onto a gRPC status in the service layer."""

    def __init__(self, msg: str, code: str = "FAILED_PRECONDITION"):
        super().__init__(msg)
        self.code = code
