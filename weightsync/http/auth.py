"""Bearer-token check for the protected HTTP routes, as pure ASGI middleware.

It runs on the request's headers alone, before any route, body parsing or validation: an
unauthenticated request costs a header comparison, and its body is never read (the 401 closes the
connection, so the unread body is not drained either). The token and the comparison are those of
the gRPC interceptor. A request must carry exactly one `Authorization: Bearer <token>` header:
several headers are refused rather than accepted when any of them matches. With no token
configured every route is open, as the gRPC API is. A scoped token (`scoped`) grants only the
protected routes under its own prefixes (the rollout's generation key: the OpenAI surface).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from weightsync.http.errors import error_bytes

#: Route prefixes that need the token; probes, metrics and the schema stay open.
PROTECTED_PREFIXES = ("/v1/",)


def is_protected(path: str, prefixes: Iterable[str] = PROTECTED_PREFIXES) -> bool:
    return any(path.startswith(p) for p in prefixes)


def auth_failure(header_values: list[bytes], expected: bytes) -> str | None:
    """Why the request's Authorization headers do not authenticate it, or None when they do."""
    if len(header_values) == 1 and hmac.compare_digest(header_values[0], expected):
        return None
    if len(header_values) > 1:
        return "send exactly one Authorization header"
    return (
        "missing or wrong token: send 'Authorization: Bearer <token>' "
        "(the token of auth_token / auth_token_file; openai clients: api_key=<token>)"
    )


class BearerAuth:
    def __init__(
        self,
        app,
        token: str,
        prefixes: Iterable[str] = PROTECTED_PREFIXES,
        scoped: Iterable[tuple[str, tuple[str, ...]]] = (),
    ):
        self.app, self.prefixes = app, tuple(prefixes)
        self.expected = f"Bearer {token}".encode() if token else None
        #: (b"Bearer <token>", route prefixes it grants) for each narrower token
        self.scoped = [(f"Bearer {t}".encode(), tuple(p)) for t, p in scoped if t]

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or not is_protected(scope["path"], self.prefixes):
            return await self.app(scope, receive, send)
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        why = auth_failure(values, self.expected)
        for expected, prefixes in self.scoped:
            if why is not None and auth_failure(values, expected) is None:
                why = None if scope["path"].startswith(prefixes) else "this token does not grant this route"
        if why is None:
            return await self.app(scope, receive, send)
        body = error_bytes(401, why, code="invalid_api_key")
        # Connection: close: the server drops the connection after the answer instead of reading
        # (and discarding) whatever body the client still sends.
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
