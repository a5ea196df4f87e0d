"""The publisher's REST mirror of the fleet API: GET /v1/status and POST /v1/sync.

Both go through the gRPC servicer's own methods, so validation, errors and results are those of
`wsctl status --json` / `wsctl sync --json` (the same JSON field names, from the same messages).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ConfigDict, Field

from weightsync.bus.transports import choices
from weightsync.http.grpc_bridge import call
from weightsync.http.types import Text
from weightsync.v1 import trainer_pb2


class SyncBody(BaseModel):
    """The options of `wsctl sync` (gRPC SyncRequest)."""

    model_config = ConfigDict(extra="forbid")
    rollout_ids: list[Text] = Field(default_factory=list, description="rollout ids to sync; empty = every rollout")
    transport: Text = Field("", description=f"{choices()}; empty = the trainer's default transport")
    timeout_seconds: float = Field(0.0, description="per-sync timeout in seconds; 0 = the trainer's sync_timeout_s")
    senders: Text = Field(
        "", description="who streams: all (every rank that owns tensors) or rank0; empty = the trainer's bus.senders"
    )
    allow_rollback: bool = Field(
        False,
        description="let rollouts go back to a lower version of this trainer (refused otherwise; logged and counted)",
    )


def _as_dict(msg) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


_ERRORS = {
    400: {"description": "invalid option (the message names it)"},
    401: {"description": "missing or wrong token"},
    404: {"description": "unknown rollout id"},
    409: {"description": "another sync is running"},
}


def trainer_router(servicer) -> APIRouter:
    """The token is checked before any route runs (weightsync/http/auth.py)."""
    r = APIRouter(prefix="/v1", tags=["admin"])

    @r.get(
        "/status",
        summary="trainer version, registered rollouts and their versions, the last sync report",
        responses={401: _ERRORS[401]},
    )
    def status() -> dict[str, Any]:
        return _as_dict(call(servicer.GetStatus, trainer_pb2.TrainerStatusRequest()))

    @r.post(
        "/sync",
        summary="publish the trainer's weights to rollouts and wait for the report",
        description="The body is optional; `ok` in the report says whether every target committed.",
        responses=_ERRORS,
    )
    def sync(body: SyncBody | None = None) -> dict[str, Any]:
        body = body or SyncBody()
        req = trainer_pb2.SyncRequest(
            rollout_ids=body.rollout_ids,
            transport=body.transport,
            timeout_seconds=body.timeout_seconds,
            senders=body.senders,
            allow_rollback=body.allow_rollback,
        )
        return _as_dict(call(servicer.Sync, req).report)

    return r
