"""One error body for the whole HTTP surface: OpenAI's `{"error": {"message", "type", "param", "code"}}`.

OpenAI clients print `error.message` (the openai package puts it in the exception text) and
ignore everything else, so the message carries the whole story: the field, what was wrong, the fix.
Every error path of the app ends here: routes raise `ApiError` (or FastAPI's HTTPException),
request validation, unknown routes, the auth middleware and the body limit build the same body.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# OpenAI's `type` per status; `code` is a short machine-readable string where one helps a client.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout_error",
}


class ErrorDetail(BaseModel):
    message: str = Field(..., description="what was wrong and how to fix it; names the field")
    type: str = Field(..., description="invalid_request_error, authentication_error, not_found_error, ...")
    param: str | None = Field(None, description="the request field at fault, if one is")
    code: str | None = Field(None, description="a short machine-readable reason, if one helps")


class ErrorBody(BaseModel):
    """OpenAI's error object, for every status >= 400."""

    error: ErrorDetail


class ApiError(Exception):
    """Raise from a route: answered as `status` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_payload(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_bytes(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """The body as bytes, for pure-ASGI answers that never reach FastAPI (auth, body limit)."""
    return json.dumps(error_payload(status, message, param, code)).encode()


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_payload(status, message, param, code), status_code=status, headers=headers)


def _field(loc) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


# Shown by the schema for every route; the status codes are the ones this app really answers
# (no 422: validation errors are 400).
ERROR_RESPONSE = {"model": ErrorBody}


def install_error_handlers(app: FastAPI, not_found_hint: str) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        # One readable line naming the fields first (clients print only the message).
        errs = exc.errors()
        msg = "; ".join(f"{_field(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errs[:5])
        param = _field(errs[0].get("loc", ())) if errs else None
        return error_response(400, f"invalid request: {msg}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":  # no such route (a route's own 404 has its message)
            detail = f"not found: {request.method} {request.url.path}; {not_found_hint}"
        elif exc.status_code == 405:
            detail = f"method {request.method} not allowed on {request.url.path}"
        return error_response(exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
