"""Build a gRPC server with the standard health service, auth, and a clear bind error."""
from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from weightsync.control.auth import TokenAuthInterceptor

# Buckets never ride the control plane (except IPC handles), but manifests of big models do.
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
]


class BindError(RuntimeError):
    pass


class ServiceServer:
    """A started gRPC server plus its health servicer (SERVING/NOT_SERVING per service name)."""

    def __init__(self, address: str, token: str, max_workers: int = 16):
        interceptors = [TokenAuthInterceptor(token)] if token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                                  interceptors=interceptors, options=GRPC_OPTIONS)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise BindError(f"cannot listen on {address}: {exc} (is the port in use? pick another grpc_address)") from None
        if self.port == 0:
            raise BindError(f"cannot listen on {address}: port in use or address not available; pick another grpc_address")
        self.address = address.rsplit(":", 1)[0] + f":{self.port}"

    def set_serving(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(service, status)
        self.health.set("", status)

    def start(self) -> None:
        self.server.start()

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1)
