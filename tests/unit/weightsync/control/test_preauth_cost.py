"""An unauthenticated gRPC call is refused on its metadata, before its request is read.

Two concurrent 200 MiB unary calls without a token used to raise the server's memory by ~0.7 GiB
(grpcio receives a unary request whole before any handler runs) before UNAUTHENTICATED.
"""

from __future__ import annotations

import subprocess
import sys
import time

from weightsync.control.grpc_server import ServiceServer
from weightsync.v1 import trainer_pb2_grpc

CLIENT = r"""
import grpc, sys, threading
ch = grpc.insecure_channel(sys.argv[1], options=[("grpc.max_send_message_length", 300 << 20)])
call = ch.unary_unary("/weightsync.v1.Trainer/LoadWeights", request_serializer=lambda x: x,
                      response_deserializer=lambda x: x)
codes = []
def one():
    try:
        call(b"\x0a\xff\xff\xff\x64" + b"a" * (200 << 20), timeout=60, metadata=[("authorization", "Bearer wrong")])
        codes.append("OK")
    except grpc.RpcError as e:
        codes.append(e.code().name)
ts = [threading.Thread(target=one) for _ in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
print(",".join(codes))
"""


def _rss_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_unauthenticated_large_requests_cost_the_server_almost_nothing():
    srv = ServiceServer("127.0.0.1:0", "tok")
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer_pb2_grpc.TrainerServicer(), srv.server)
    srv.start()
    try:
        before = peak = _rss_mib()
        p = subprocess.Popen([sys.executable, "-c", CLIENT, srv.address], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline:
            peak = max(peak, _rss_mib())
            time.sleep(0.01)
        out, _ = p.communicate(timeout=30)
        assert out.strip() == "UNAUTHENTICATED,UNAUTHENTICATED", out
        assert peak - before < 100, f"server RSS grew by {peak - before} MiB for refused calls"
    finally:
        srv.stop()
