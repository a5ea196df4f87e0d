"""Call a gRPC servicer method from an HTTP route, so both APIs share one validation path.

The servicer aborts with a gRPC status; the route answers the matching HTTP status with the same
message. `is_active` lets a long call notice that the HTTP client went away.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from fastapi import HTTPException

# gRPC status -> HTTP status (the mapping of google.rpc / grpc-gateway).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class HttpCallContext:
    """The part of grpc.ServicerContext our servicers use."""

    def __init__(self, is_active: Callable[[], bool] = lambda: True):
        self._is_active = is_active

    def abort(self, code: grpc.StatusCode, details: str):
        raise Aborted(code, details)

    def is_active(self) -> bool:
        return self._is_active()

    def add_callback(self, callback) -> bool:
        return False  # no completion callbacks over HTTP; callers poll is_active()

    def time_remaining(self):
        return None


def call(method, request, is_active: Callable[[], bool] = lambda: True):
    try:
        return method(request, HttpCallContext(is_active))
    except Aborted as exc:
        raise HTTPException(HTTP_STATUS.get(exc.code, 500), f"{exc.code.name}: {exc.details}") from None
