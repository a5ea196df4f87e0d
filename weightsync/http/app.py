"""Build a service's FastAPI app and start serving it: probes, metrics, and the service's routers."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry

from weightsync.http.health import health_router
from weightsync.http.server import HttpServer

log = logging.getLogger(__name__)


def _field(loc) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


MAX_BODY_BYTES = 16 << 20


class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413 before reading them into memory
    (uvicorn has no limit of its own). Declared lengths are checked up front, chunked bodies as they arrive."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and (not v.isdigit() or int(v) > self.limit):
                return await PlainTextResponse(f"request body over {self.limit} bytes\n", 413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"request body over {self.limit} bytes")
            return msg

        return await self.app(scope, limited, send)


def make_app(title: str, registry: CollectorRegistry, ready: Callable[[], tuple[bool, str]],
             routers: Iterable = ()) -> FastAPI:
    # No /docs or /redoc: they pull JavaScript from a CDN. The schema is at /openapi.json.
    app = FastAPI(title=title, docs_url=None, redoc_url=None, version="1")
    app.add_middleware(BodyLimit)
    app.include_router(health_router(registry, ready))
    for router in routers:
        app.include_router(router)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        # One readable line naming the field first (clients print `detail`), the structured list after.
        errs = exc.errors()
        msg = "; ".join(f"{_field(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errs[:5])
        return JSONResponse({"detail": f"invalid request: {msg}",
                             "errors": [{"loc": list(map(str, e.get("loc", ()))), "msg": str(e.get("msg", ""))}
                                        for e in errs[:20]]}, status_code=400)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        detail = getattr(exc, "detail", None)
        if detail and detail != "Not Found":  # a route's own 404 (e.g. an unknown rollout id)
            return JSONResponse({"detail": detail}, status_code=404)
        return PlainTextResponse("not found: try /healthz, /readyz, /metrics, /openapi.json\n", status_code=404)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    return app


def serve_http(address: str, *, title: str, registry: CollectorRegistry, ready: Callable[[], tuple[bool, str]],
               routers: Iterable = ()) -> HttpServer:
    """Bind `address` now (a clash raises here), serve once `.start()` is called."""
    return HttpServer(address, make_app(title, registry, ready, routers))
