"""Generation metrics of gRPC Generate (latency, tokens, in flight), around the servicer's handler.

The HTTP completions share `RolloutServicer.generate` but not this wrapper: their handlers record
their own endpoint with `servicer.rollout_metrics.generation("http_completions")`.
"""

from __future__ import annotations

from collections.abc import Callable

from weightsync.obs import tracing
from weightsync.obs.metrics import RolloutMetrics


def metered_generate(generate: Callable, metrics: RolloutMetrics) -> Callable:
    """`generate` (the servicer's Generate handler) recording endpoint `grpc_generate`: each prompt's
    tokens once and every returned sample's tokens, for requests that return an answer."""

    def Generate(request, context):
        carrier = dict(context.invocation_metadata()) if tracing.enabled() else None
        with tracing.generation_span("grpc_generate", carrier), metrics.generation("grpc_generate") as done:
            response = generate(request, context)  # context.abort raises: no answer, nothing recorded
            done(sum(len(p.token_ids) for p in request.prompts), sum(len(s.token_ids) for s in response.samples))
        return response

    return Generate
