"""Build a gRPC server with the standard health service, auth, and a clear bind error."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from weightsync.control.auth import TokenAuthInterceptor

# Buckets never ride the control plane (except IPC handles), but manifests of big models (~10^5
# tensors, 10-20 MB) and TrainStep batches (samples x tokens) do. Services bound individual methods
# tighter (`request_limits`), e.g. a rollout's PrepareSync by the manifest size of its own model.
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
]


class BindError(RuntimeError):
    pass


class DecodeGuardInterceptor(grpc.ServerInterceptor):
    """Answer a request that is not a valid protobuf message with INVALID_ARGUMENT.

    grpcio deserializes before the handler runs and reports a parse failure as INTERNAL, which
    reads as a server bug; a garbled request is the client's error. Unary-unary handlers only
    (every weightsync RPC is one); streaming handlers pass through unchanged.
    """

    def __init__(self, request_limits: dict[str, int] | None = None):
        #: full method name -> largest request accepted, in bytes (checked before parsing)
        self.request_limits = request_limits if request_limits is not None else {}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if (
            handler is None
            or handler.request_streaming
            or handler.response_streaming
            or handler.request_deserializer is None
        ):
            return handler
        deserialize, behavior, method = handler.request_deserializer, handler.unary_unary, handler_call_details.method

        def guarded(raw: bytes, context):
            limit = self.request_limits.get(method)
            if limit is not None and len(raw) > limit:
                # Refused on its length: parsing a hostile 28 MB message alone costs most of a second.
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: request of {len(raw)} bytes exceeds this server's limit of {limit} "
                    "bytes for it (a manifest larger than this model's can be)",
                )
            try:
                request = deserialize(raw)
            except Exception as exc:  # protobuf DecodeError (and any other parse failure)
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid protobuf message ({exc})"
                )
            return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=None, response_serializer=handler.response_serializer
        )


class ServiceServer:
    """A started gRPC server plus its health servicer (SERVING/NOT_SERVING per service name)."""

    def __init__(
        self,
        address: str,
        token: str,
        max_workers: int = 16,
        scoped_tokens: tuple[tuple[str, tuple[str, ...]], ...] = (),
    ):
        """`scoped_tokens`: (token, method prefixes) granting less than `token` (TokenAuthInterceptor)."""
        self.decode_guard = DecodeGuardInterceptor()
        #: full method name -> largest request in bytes; a service fills it once it knows its model
        self.request_limits = self.decode_guard.request_limits
        self.auth = TokenAuthInterceptor(token, scoped_tokens) if token else None
        interceptors = ([self.auth] if self.auth else []) + [self.decode_guard]
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            interceptors=interceptors,
            options=GRPC_OPTIONS,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise BindError(
                f"cannot listen on {address}: {exc} (is the port in use? pick another grpc_address)"
            ) from None
        if self.port == 0:
            raise BindError(
                f"cannot listen on {address}: port in use or address not available; pick another grpc_address"
            )
        self.address = address.rsplit(":", 1)[0] + f":{self.port}"

    def auth_failures(self) -> int:
        """Calls the token check refused (0 without a token: nothing is checked)."""
        return self.auth.denied if self.auth is not None else 0

    def set_serving(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(service, status)
        self.health.set("", status)

    def start(self) -> None:
        self.server.start()

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1)
