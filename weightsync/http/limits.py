"""Request body limits, as pure ASGI middleware: a size cap and a deadline for the whole body.

uvicorn has neither. The size is checked on the declared Content-Length before anything is read,
and on the bytes as they arrive (chunked bodies): over the cap is a 413, and at most one chunk past
the cap is ever held. The deadline bounds how long a client may take to send its body once a route
starts reading it (a trickled body would otherwise hold the request open for as long as the client
likes): past it, 408. Both answers close the connection rather than drain the rest of the body.
"""

from __future__ import annotations

import time

import anyio
from starlette.exceptions import HTTPException

from weightsync.http.errors import error_bytes

MAX_BODY_BYTES = 16 << 20
BODY_TIMEOUT_S = 30.0
_CLOSE = {"Connection": "close"}


class BodyLimit:
    def __init__(self, app, limit: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and (not v.isdigit() or int(v) > self.limit):
                body = error_bytes(413, f"request body over {self.limit} bytes (Content-Length {v.decode('latin-1')})")
                await send(
                    {
                        "type": "http.response.start",
                        "status": 413,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        seen, deadline, done = 0, None, False

        async def limited():
            nonlocal seen, deadline, done
            if done:  # the body is in: later receives wait for a disconnect, as long as the response lasts
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            try:
                with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                    msg = await receive()
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"request body not received within {self.timeout_s:.0f}s; send the whole body at once",
                    headers=_CLOSE,
                ) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"request body over {self.limit} bytes", headers=_CLOSE)
                done = not msg.get("more_body", False)
            return msg

        return await self.app(scope, limited, send)
