"""Bearer-token check for the REST routes: the same token and comparison as the gRPC interceptor.

A request must carry exactly one `Authorization: Bearer <token>` header: several headers are refused
rather than accepted when any of them matches. With no token configured the routes are open, as
the gRPC API is.
"""
from __future__ import annotations

import hmac

from fastapi import HTTPException, Request


def bearer_auth(token: str):
    expected = f"Bearer {token}".encode()

    def check(request: Request) -> None:
        if not token:
            return
        values = request.headers.getlist("authorization")
        if len(values) != 1 or not hmac.compare_digest(values[0].encode(), expected):
            detail = ("send exactly one Authorization header" if len(values) > 1 else
                      "missing or wrong control-plane token: send 'Authorization: Bearer <token>' "
                      "(the token of auth_token / auth_token_file)")
            raise HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})

    return check
