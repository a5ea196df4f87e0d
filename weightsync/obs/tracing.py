"""OpenTelemetry traces of a sync across both services, and of generation requests; nothing when off.

A sync is one trace: the trainer's root span `sync`, its phases `plan`, `prepare`, `stream`, `commit`
as children (a retried attempt adds spans of the same names), one `stream.sender` span per sending
rank under the stream and, under each, one `stream.group` span per group of its buckets (first and
last bucket index, buckets, bytes; at most 16 a sender: weightsync/obs/bucket_groups.py), and on
each rollout `rollout.prepare` / `rollout.commit` continuing the phase span it is handed in the
request's W3C `traceparent` (over gRPC and over the sync link alike: both carry the same messages).
Generation requests continue the `traceparent` of their gRPC metadata or HTTP headers.

On when OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, the standard
variables: spans go to that collector over OTLP/HTTP (the `otel` extra). Or an embedding process
(a test) hands its own TracerProvider to `configure`. Off, no opentelemetry module is imported and
every helper is a shared no-op: a sync pays one global read per phase.

The trainer runs one sync at a time per process (the orchestrator's lock), so the open sync is
module state read from the RPC pool's threads too (contextvars do not follow work into a pool).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from weightsync.obs import logs

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
#: attribute names (one namespace, so a trace backend lists them together)
SYNC_ID, VERSION, ROUTE, BYTES, ROLLOUT_ID = (
    "weightsync.sync_id",
    "weightsync.version",
    "weightsync.route",
    "weightsync.bytes",
    "weightsync.rollout_id",
)
#: how a rollout's prepare or commit came: "rpc" (a call, over gRPC or the sync link) or "ipc_stream"
VIA = "weightsync.via"

_lock = threading.Lock()
_tracer: Any = None  # an opentelemetry Tracer once on
_provider: Any = None  # the TracerProvider this module made from the environment (None: none, or a caller's)
_resolved = False  # the environment was read (once per process, unless configure() says otherwise)
_service = "weightsync"
_open: _SyncTrace | None = None  # the trainer's sync in progress (see the module doc)


def setup(service: str) -> None:
    """Name this process's spans (`service.name`); the endpoint is read at the first span."""
    global _service
    _service = service


def configure(provider: Any | None) -> None:
    """Trace into `provider` (an opentelemetry.sdk TracerProvider), or None: back to the environment."""
    global _tracer, _resolved, _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()  # the one made from the environment: its batch thread ends here
        _tracer = provider.get_tracer("weightsync") if provider is not None else None
        _resolved, _provider = provider is not None, None


def enabled() -> bool:
    return _get() is not None


def _get() -> Any:
    global _tracer, _resolved
    if _resolved:
        return _tracer
    with _lock:
        if not _resolved:
            _tracer = _from_environment() if any(os.environ.get(v) for v in ENDPOINT_VARS) else None
            _resolved = True
    return _tracer


def _from_environment() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed (%s): no traces; "
            "install weightsync[otel] or unset the variable",
            exc,
        )
        return None
    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, when set, win over the service's own name
    global _provider
    # batched on a thread of its own; flushed at exit (the SDK's shutdown_on_exit) or by `flush`
    _provider = TracerProvider(resource=Resource.create({"service.name": _service}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return _provider.get_tracer("weightsync")


def flush(timeout_s: float = 5.0) -> bool:
    """Send the spans the OTLP exporter still holds; True when there were none left or all went out."""
    return True if _provider is None else bool(_provider.force_flush(int(timeout_s * 1000)))


# ---- W3C trace context ------------------------------------------------------------------------
def _propagator():
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def traceparent() -> str:
    """The W3C traceparent of the current span ("" when off or outside a span), for a request field."""
    if _get() is None:
        return ""
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.get_span_context().is_valid and _open is not None:
        span = _open.current  # a pool thread of the open sync: its phase
    carrier: dict[str, str] = {}
    _propagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def call_traceparent() -> str:
    """The traceparent an outgoing call (a Generate) carries so the callee continues the caller's trace:
    that of the caller's current span, be it ours or one of the embedding process's own OpenTelemetry
    (an RL loop tracing its steps); "" outside a span. Off here and with no OpenTelemetry SDK loaded by
    the process (the API alone, which some libraries import, records no span), it is two reads."""
    if _get() is None and "opentelemetry.sdk.trace" not in sys.modules:
        return ""
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _propagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def _parent(traceparent_value: str):
    return _propagator().extract({"traceparent": traceparent_value}) if traceparent_value else None


# ---- the trainer's side of a sync ------------------------------------------------------------
class _SyncTrace:
    def __init__(self, root):
        self.root = root
        self.current = root  # the phase span open now (the root between phases)
        self.stream_start_ns: int | None = None
        self.groups: dict[int, list[list]] = {}  # sender rank -> its bucket groups (obs/bucket_groups.py)

    def finish(self, report) -> None:
        """The sync's report: its attributes on the root, one span per sending rank under the stream."""
        if report is None:
            return
        self.root.set_attributes(_report_attributes(report))
        self.root.set_attribute("weightsync.ok", bool(report.ok))
        if self.stream_start_ns is None:
            return
        from opentelemetry import trace

        parent = trace.set_span_in_context(self.stream_span)
        for s in report.senders:
            # a sender's own stream may run in another process (a rank of its own): timed by its
            # result, placed from the stream's start
            span = _get().start_span(
                "stream.sender",
                context=parent,
                start_time=self.stream_start_ns,
                attributes={"weightsync.rank": s.rank, BYTES: s.bytes, "weightsync.buckets": s.num_buckets},
            )
            if s.error:
                span.set_attribute("error.message", s.error)
            self._group_spans(span, self.groups.get(s.rank, ()))
            span.end(end_time=self.stream_start_ns + int(s.seconds * 1e9))

    def _group_spans(self, sender, groups) -> None:
        from opentelemetry import trace

        parent = trace.set_span_in_context(sender)
        for first, last, count, nbytes, start_s, end_s in groups:
            attributes = {
                "weightsync.bucket.first": first,
                "weightsync.bucket.last": last,
                "weightsync.buckets": count,
                BYTES: nbytes,
            }
            span = _get().start_span(
                "stream.group",
                context=parent,
                start_time=self.stream_start_ns + int(start_s * 1e9),
                attributes=attributes,
            )
            span.end(end_time=self.stream_start_ns + int(end_s * 1e9))


class _NoTrace:
    def finish(self, report) -> None:
        pass


_NO_TRACE = _NoTrace()


def _report_attributes(report) -> dict[str, Any]:
    # the route, once a report names one; until then the transport is the route's first part
    route = getattr(report, "route", "") or report.transport
    return {SYNC_ID: report.sync_id, VERSION: int(report.version), ROUTE: route, BYTES: int(report.bytes)}


@contextlib.contextmanager
def sync_span(transport: str) -> Iterator[_SyncTrace | _NoTrace]:
    """The trainer's root span of one sync; the caller hands the report to `finish`. Also the scope of
    the sync id in the JSON logs (set by `planned`)."""
    global _open
    tracer = _get()
    with logs.context():
        if tracer is None:
            yield _NO_TRACE
            return
        with tracer.start_as_current_span("sync", attributes={ROUTE: transport}) as root:
            _open = _SyncTrace(root)
            try:
                yield _open
            finally:
                _open = None


def planned(sync_id: str, version: int, total_bytes: int) -> None:
    """The plan named the sync: its id in the logs and on the root span."""
    logs.bind(sync_id=sync_id)
    if _open is not None:
        _open.root.set_attributes({SYNC_ID: sync_id, VERSION: int(version), BYTES: int(total_bytes)})


def sender_groups(rank: int, groups: list[list]) -> None:
    """A sender's bucket groups (BucketGroups.groups), made spans under its `stream.sender` at the end."""
    if _open is not None and groups:
        _open.groups[rank] = groups


_OFF = contextlib.nullcontext()  # reusable: what every helper hands out while tracing is off


def phase(name: str) -> contextlib.AbstractContextManager:
    """One phase of the open sync (plan, prepare, stream, commit) as a child of its root."""
    if _open is None or _get() is None:
        return _OFF
    return _phase_span(name, _open)


@contextlib.contextmanager
def _phase_span(name: str, trace: _SyncTrace) -> Iterator[None]:
    with _get().start_as_current_span(name, attributes={"weightsync.phase": name}) as span:
        trace.current = span
        if name == "stream":
            trace.stream_span, trace.stream_start_ns = span, time.time_ns()
        try:
            yield
        finally:
            trace.current = trace.root


# ---- the rollout's side ----------------------------------------------------------------------
@contextlib.contextmanager
def continued(name: str, parent: str, attributes: Mapping[str, Any]) -> Iterator[None]:
    """A span of this process continuing the W3C `parent` traceparent (a root span when "")."""
    tracer = _get()
    if tracer is None:
        yield
        return
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span(name, context=_parent(parent), kind=SpanKind.SERVER, attributes=attributes):
        yield


def traced_sync_handlers(servicer) -> None:
    """Wrap a rollout servicer's PrepareSync and CommitSync (gRPC and the sync link both call these
    attributes) and its commit_from_stream (the commit that ends an IpcBuckets stream) in spans
    continuing the trainer's, and scope the sync id in the JSON logs."""

    def wrap(handler: Callable, name: str, sync_of: Callable, via: str) -> Callable:
        def traced(request, *context):
            sync_id, version = sync_of(request)
            attributes = {SYNC_ID: sync_id, VERSION: int(version), ROLLOUT_ID: servicer.rollout_id, VIA: via}
            with logs.context(sync_id=sync_id), continued(name, request.traceparent, attributes):
                return handler(request, *context)

        return traced

    def prepared(r):
        return r.manifest.sync_id, r.manifest.version

    def committed(r):
        return r.sync_id, r.version

    servicer.PrepareSync = wrap(servicer.PrepareSync, "rollout.prepare", prepared, "rpc")
    servicer.CommitSync = wrap(servicer.CommitSync, "rollout.commit", committed, "rpc")
    servicer.commit_from_stream = wrap(servicer.commit_from_stream, "rollout.commit", committed, "ipc_stream")


def generation_span(endpoint: str, carrier: Mapping[str, str] | None) -> contextlib.AbstractContextManager:
    """A generation request's span continuing the `traceparent` of its headers or gRPC metadata."""
    if _get() is None:
        return _OFF
    return continued("generate", (carrier or {}).get("traceparent", ""), {"weightsync.endpoint": endpoint})
