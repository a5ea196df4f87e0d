"""The two ways a sync fails on the weight bus.

TransportError: moving bytes failed (peer gone, timeout, corrupt frame); raised by channels.
SyncError: a rollout cannot take part in a sync (bad request, wrong GPU, no such group); its
`code` names the gRPC status the rollout answers with.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """Moving bytes failed (peer gone, timeout, corrupt frame). The sync must abort."""


class SyncError(RuntimeError):
    """The sync cannot proceed; `code` maps onto a gRPC status in the service layer."""

    def __init__(self, msg: str, code: str = "FAILED_PRECONDITION"):
        super().__init__(msg)
        self.code = code
