"""Build a service's FastAPI app and start serving it: probes, metrics, and the service's routers.

Middleware order matters: the token is checked first, on headers alone, then the body limits; only
an authenticated request within the limits reaches FastAPI, which reads and parses its body.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from weightsync.http.auth import PROTECTED_PREFIXES, BearerAuth, is_protected
from weightsync.http.errors import install_error_handlers
from weightsync.http.health import health_router
from weightsync.http.limits import BODY_TIMEOUT_S, BodyLimit
from weightsync.http.openapi import install_openapi
from weightsync.http.server import HttpServer

log = logging.getLogger(__name__)


def make_app(
    title: str,
    registry: CollectorRegistry,
    ready: Callable[[], tuple[bool, str]],
    routers: Iterable = (),
    token: str = "",
    body_timeout_s: float = BODY_TIMEOUT_S,
    scoped_tokens: tuple[tuple[str, tuple[str, ...]], ...] = (),
) -> FastAPI:
    # No /docs or /redoc: they pull JavaScript from a CDN. The schema is at /openapi.json.
    app = FastAPI(title=title, docs_url=None, redoc_url=None, version="1")
    app.add_middleware(BodyLimit, timeout_s=body_timeout_s)
    app.add_middleware(BearerAuth, token=token, scoped=scoped_tokens)  # added last = runs first
    app.include_router(health_router(registry, ready))
    for router in routers:
        app.include_router(router)
    install_error_handlers(app, "try /healthz, /readyz, /metrics, /openapi.json")
    install_openapi(app, lambda path: is_protected(path, PROTECTED_PREFIXES), token_required=bool(token))
    return app


def serve_http(
    address: str,
    *,
    title: str,
    registry: CollectorRegistry,
    ready: Callable[[], tuple[bool, str]],
    routers: Iterable = (),
    token: str = "",
    scoped_tokens: tuple[tuple[str, tuple[str, ...]], ...] = (),
) -> HttpServer:
    """Bind `address` now (a clash raises here), serve once `.start()` is called. With a `token`,
    every `/v1/` route needs it (weightsync/http/auth.py); probes, metrics and the schema stay open."""
    return HttpServer(address, make_app(title, registry, ready, routers, token, scoped_tokens=scoped_tokens))
