"""Client channels to the services: auth metadata, message limits, per-call deadlines."""

from __future__ import annotations

import grpc

from weightsync.control.auth import call_metadata
from weightsync.control.grpc_server import GRPC_OPTIONS
from weightsync.obs import tracing
from weightsync.v1 import rollout_pb2_grpc, trainer_pb2_grpc


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[o for o in GRPC_OPTIONS if o[0] != "grpc.so_reuseport"])


class _Authed:
    """Wraps a generated stub so that every call carries the token and a deadline, and, made under a
    current span, its W3C traceparent (a rollout's Generate continues the caller's trace)."""

    def __init__(self, stub, token: str, timeout: float):
        self._stub = stub
        self._md = call_metadata(token)
        self.timeout = timeout

    def __getattr__(self, name):
        method = getattr(self._stub, name)

        def call(request, timeout: float | None = None):
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata())

        return call

    def future(self, name: str, request, timeout: float | None = None) -> grpc.Future:
        """RPC `name` started without waiting for it (its answer: `.result()`), with the token and deadline."""
        return getattr(self._stub, name).future(request, timeout=timeout or self.timeout, metadata=self._metadata())

    def _metadata(self) -> tuple:
        parent = tracing.call_traceparent()
        return (*self._md, ("traceparent", parent)) if parent else self._md


def rollout_stub(ch: grpc.Channel, token: str, timeout: float = 30.0):
    return _Authed(rollout_pb2_grpc.RolloutStub(ch), token, timeout)


def trainer_stub(ch: grpc.Channel, token: str, timeout: float = 30.0):
    return _Authed(trainer_pb2_grpc.TrainerStub(ch), token, timeout)


def describe_rpc_error(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'UNKNOWN'}: {details}"


def last_logits(address: str, token_ids: list[int], token: str = "", timeout: float = 60.0):
    """The rollout's float32 logits at the last position of `token_ids` (Score with return_last_logits,
    a torch tensor [vocab]) and the weights version that computed them: what a bit-exact check of a
    sync compares against the trainer's own forward."""
    import numpy as np  # lazy: the control plane imports no tensor library at start
    import torch

    from weightsync.v1 import rollout_pb2

    ch = channel(address)
    try:
        r = rollout_stub(ch, token=token, timeout=timeout).Score(
            rollout_pb2.ScoreRequest(token_ids=token_ids, prompt_length=1, return_last_logits=True)
        )
    finally:
        ch.close()
    return torch.from_numpy(np.frombuffer(r.last_logits_f32, dtype="<f4").copy()), r.version
