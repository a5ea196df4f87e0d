"""Logging setup: human text or one JSON object per line (for log pipelines such as Loki or ELK).

A JSON line carries `time`, `level`, `service`, `logger`, `message`, and the sync and rollout it is
about (`sync_id`, `rollout_id`) when known: from the record's `extra`, else from the scope a sync
runs in (`context` / `bind`, a context variable, so concurrent requests keep theirs), else from the
process (`process_fields`: a rollout's own id).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

FORMATS = ("text", "json")
#: what a line may say about its sync and rollout, in this order
_CONTEXT_KEYS = ("sync_id", "version", "rollout_id")

_scope: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("weightsync_log_scope", default=None)
_process: dict[str, str] = {}


@contextlib.contextmanager
def context(**fields: str) -> Iterator[None]:
    """Lines logged in this block (this thread or task) carry `fields`; `bind` adds to them."""
    token = _scope.set({**(_scope.get() or {}), **fields})
    try:
        yield
    finally:
        _scope.reset(token)


def bind(**fields: str) -> None:
    """Add `fields` to the current `context` block. Outside one it does nothing: a field bound for good
    would label every later line of the thread (a sync id on the next sync's lines)."""
    scope = _scope.get()
    if scope is not None:
        scope.update(fields)


def process_fields(**fields: str) -> None:
    """Fields every line of this process carries (e.g. a rollout's rollout_id)."""
    _process.update(fields)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        scope = _scope.get() or {}
        for key in _CONTEXT_KEYS:
            value = getattr(record, key, None) or scope.get(key) or _process.get(key)
            if value:
                obj[key] = value
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


def setup_logging(service: str, level: str = "INFO", fmt: str = "text") -> None:
    if fmt not in FORMATS:
        raise ValueError(f"log_format={fmt!r} must be one of {FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
