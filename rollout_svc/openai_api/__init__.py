"""The OpenAI-compatible HTTP surface of a rollout, for agent environments and clients that speak it.

`GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions` (SSE streaming for both)
run through the gRPC Generate path and report the weight version of every answer.
Differences from OpenAI's API, all explicit (docs/operations.md): a prompt may be token ids (the
tiny built-in models have no tokenizer; text and chat need a model directory with one); log-probs
are the sampled token's only; `token_ids` and `weight_version` (also the `X-Weight-Version` header)
are extensions. Both engines (built-in, SGLang) stream token by token (routes.py).
"""

from rollout_svc.openai_api.routes import Served, rollout_router

__all__ = ["Served", "rollout_router"]
