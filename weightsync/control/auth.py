"""Shared-token authentication for the control plane.

The token comes from env, a config file or (in Kubernetes) a file mounted from a Secret. Clients send
it as `authorization: Bearer <token>` metadata; the server interceptor rejects calls without
it (UNAUTHENTICATED) except the gRPC health service, which kubelet probes call unauthenticated.
The TCP data plane proves the same token with an HMAC over the sync id (weightsync.bus.tcp.wire).

Besides that admin token, which grants every call, a service may accept *scoped* tokens, each
granting only the methods under its prefixes (the rollout's generation key: Generate and Score),
so the key handed to inference clients cannot sync, load or abort weights.
"""

from __future__ import annotations

import hmac
import itertools
from collections.abc import Iterable
from pathlib import Path

import grpc

from weightsync.config import ConfigError

_HEADER = "authorization"
_OPEN_METHODS = ("/grpc.health.v1.Health/",)


def check_token_file_mode(p: Path, field: str) -> None:
    """ConfigError when others (not the owner, not its group) may read or write the token file.

    Like ssh with a private key: a token others can read is not a secret. Group access is allowed,
    because a Kubernetes Secret volume gives a pod's fsGroup its files (the chart mounts the token
    0440); anything for "others" is refused. `p` is followed through symlinks (Secret volumes are)."""
    mode = p.stat().st_mode & 0o777
    if mode & 0o007:
        raise ConfigError(
            f"{field}: {p} has mode {mode:04o}, which lets every local user read the token; run "
            f"`chmod 600 {p}` (in Kubernetes, mount the Secret with defaultMode 0400 or 0440)"
        )


def load_token(token: str, token_file: str, field_prefix: str = "", field: str = "auth_token_file") -> str:
    if token_file:
        p = Path(token_file)
        if not p.is_file():
            raise ConfigError(f"{field_prefix}{field}: {token_file} does not exist (mount the Secret or unset it)")
        check_token_file_mode(p, field_prefix + field)
        token = p.read_text().strip()
        if not token:
            raise ConfigError(f"{field_prefix}{field}: {token_file} is empty")
    return token


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Checks the token on the call's metadata, before any of its request is read.

    A refused call is answered by a handler that takes the request as a stream and never reads
    it: grpcio receives a unary request whole before a unary handler runs, so a unary refusal
    would let any unauthenticated peer make the server buffer up to max_receive_message_length
    (256 MiB) per call. The refusal only has to match the response shape (unary or streamed)."""

    def __init__(self, token: str, scoped: Iterable[tuple[str, tuple[str, ...]]] = ()):
        """`scoped`: (token, full-method-name prefixes it grants) for each token narrower than `token`."""
        self._expected = f"Bearer {token}".encode()
        self._scoped = [(f"Bearer {t}".encode(), tuple(prefixes)) for t, prefixes in scoped if t]
        self._denials = itertools.count()  # next() is atomic under the GIL: no lock on the refusal path
        self._denied = 0

        def deny(request_iterator, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong control-plane token (wsctl --token-file / auth_token_file)",
            )

        def deny_stream(request_iterator, context):
            deny(request_iterator, context)
            yield  # never reached: a generator, as a streaming handler must be

        self._deny = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny_stream)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_OPEN_METHODS):
            return continuation(handler_call_details)
        # Exactly one authorization header: with several, a proxy and this server could each read
        # a different one (and "any of them matches" lets a caller smuggle extra credentials).
        values = [v for k, v in handler_call_details.invocation_metadata or () if k == _HEADER]
        if (
            len(values) == 1
            and isinstance(values[0], str)
            and self._grants(values[0].encode(), handler_call_details.method)
        ):
            return continuation(handler_call_details)
        self._denied = next(self._denials) + 1
        handler = continuation(handler_call_details)
        return self._deny_stream if handler is not None and handler.response_streaming else self._deny

    @property
    def denied(self) -> int:
        """Calls refused so far (a wrong or missing token, or one outside its scope)."""
        return self._denied

    def _grants(self, presented: bytes, method: str) -> bool:
        ok = hmac.compare_digest(presented, self._expected)
        for expected, prefixes in self._scoped:  # every one compared: the time does not tell which matched
            ok |= hmac.compare_digest(presented, expected) and method.startswith(prefixes)
        return ok


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((_HEADER, f"Bearer {token}"),) if token else ()
