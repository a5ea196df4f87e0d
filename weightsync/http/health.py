"""/healthz (the process answers), /readyz (the service can take traffic), /metrics (Prometheus)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def health_router(registry: CollectorRegistry, ready: Callable[[], tuple[bool, str]]) -> APIRouter:
    r = APIRouter(tags=["probes"])

    @r.get("/healthz", response_class=PlainTextResponse, summary="liveness: the process answers")
    def healthz():
        return PlainTextResponse("ok\n")

    @r.get(
        "/readyz",
        response_class=PlainTextResponse,
        summary="readiness: 200 when serving, 503 with the reason",
        responses={503: {"description": "not ready; the body says why"}},
    )
    def readyz():
        ok, reason = ready()
        return PlainTextResponse(reason + "\n", status_code=200 if ok else 503)

    @r.get("/metrics", summary="Prometheus metrics (text exposition format)")
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return r
