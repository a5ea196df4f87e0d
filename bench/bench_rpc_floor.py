"""The round-trip floor of the control plane on this host: what one prepare or commit cannot go below.

A sync's prepare and commit are each one gRPC exchange between the trainer and a rollout, so
a host's gRPC round trip bounds the fixed cost from below. This times, on loopback, with a
64-byte payload, a server in another process (as a trainer and a rollout are) and, for
comparison, in this process:

- `grpc_unary`: a unary call on a sync-API server (a thread pool, as the services run it);
- `grpc_stream`: one message and its answer on an open bidirectional stream whose requests are
  fed through a queue (as the IPC bucket stream is);
- `socket`: a blocking TCP socket echo (the host's floor: two thread wake-ups per round trip).

    OMP_NUM_THREADS=1 python -m bench rpc_floor --reps 2000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import threading
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import timing  # noqa: E402
from bench.common.results import write_result  # noqa: E402

_SERVICE = "wsbench.Echo"
_END = object()


def _serve_grpc(port_q) -> None:
    import grpc

    def unary(req, ctx):
        return req

    def stream(it, ctx):
        for req in it:
            yield req

    handler = grpc.method_handlers_generic_handler(
        _SERVICE,
        {"Unary": grpc.unary_unary_rpc_method_handler(unary), "Stream": grpc.stream_stream_rpc_method_handler(stream)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[handler])
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination(timeout=600)


def _serve_socket(port_q) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_echo, args=(conn,), daemon=True).start()


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _start(target, in_process: bool):
    if in_process:
        q: queue.Queue = queue.Queue()
        threading.Thread(target=target, args=(q,), daemon=True).start()
        return q.get(timeout=30), None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q,), daemon=True)
    proc.start()
    return q.get(timeout=60), proc


def time_grpc(port: int, reps: int, warmup: int) -> dict[str, list[float]]:
    import grpc

    payload = b"x" * 64
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        unary = ch.unary_unary(f"/{_SERVICE}/Unary")
        out = {"grpc_unary": timing.wall_samples(lambda: unary(payload, timeout=10), reps, warmup)}
        requests: queue.Queue = queue.Queue()
        answers = ch.stream_stream(f"/{_SERVICE}/Stream")(iter(requests.get, _END), timeout=600)

        def exchange():
            requests.put(payload)
            next(answers)

        out["grpc_stream"] = timing.wall_samples(exchange, reps, warmup)
        requests.put(_END)
        for _ in answers:
            pass
    return out


def time_socket(port: int, reps: int, warmup: int) -> list[float]:
    payload = b"x" * 64
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def exchange():
            s.sendall(payload)
            got = 0
            while got < len(payload):
                got += len(s.recv(65536))

        return timing.wall_samples(exchange, reps, warmup)


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_us": round(statistics.median(s) * 1e6, 1),
        "p10_us": round(s[len(s) // 10] * 1e6, 1),
        "p90_us": round(s[9 * len(s) // 10] * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    results, rows = {}, []
    for where in ("other_process", "same_process"):
        grpc_port, proc_g = _start(_serve_grpc, where == "same_process")
        sock_port, proc_s = _start(_serve_socket, where == "same_process")
        got = time_grpc(grpc_port, args.reps, args.warmup)
        got["socket"] = time_socket(sock_port, args.reps, args.warmup)
        results[where] = {k: summary(v) for k, v in got.items()}
        floor = statistics.median(got["socket"])
        for kind, v in got.items():
            rows.append({"server": where, "kind": kind, **timing.summary(v), "socket_s": floor})
        for p in (proc_g, proc_s):
            if p is not None:
                p.terminate()
                p.join(timeout=10)
    print(json.dumps(results, indent=1))
    write_result(
        "rpc_floor",
        rows,
        baseline={"what": "a blocking TCP socket echo, same server placement, same run", "rows_key": "socket_s"},
        out=args.out or None,
        device="cpu",
        cpus=os.cpu_count(),
        python=sys.version.split()[0],
        reps=args.reps,
        loadavg=os.getloadavg(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
