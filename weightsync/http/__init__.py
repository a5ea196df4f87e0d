"""The HTTP side of both services (FastAPI served by uvicorn in a thread).

`serve_http` is the one factory the services call: probes and metrics for everyone, plus the
routers a service adds (the trainer's REST admin mirror, a rollout's OpenAI-style completions).
"""

from weightsync.http.app import serve_http

__all__ = ["serve_http"]
