"""Does the trainer's own work during prepare overlap the round trip? (weightsync/publisher/straggler.py)

During PrepareSync the trainer launches its own GPU work for the sync (`meanwhile`: the megatron flat
export's conversion copies, checksums), milliseconds of Python holding the GIL, while the call's thread
sends the request and waits for the answer. Run first, that work holds the request back (its thread
needs the GIL to send it) and adds its whole time to the prepare. `gather` starts it only once every
call is on its thread (`_submit_then_yield`). Here, on a CPU: a "rollout" in another process answers
each request after `--rollout-ms`; the trainer's work is `--work-ms` of pure Python; the median time of
one gather, with that start and with a plain submit (the earlier behaviour), and without any work.

    python -m bench prepare_overlap --work-ms 0.4 --rollout-ms 0.8 --reps 300
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync.publisher import straggler  # noqa: E402


def _serve(sock: socket.socket, seconds: float) -> None:
    conn, _ = sock.accept()
    while conn.recv(64):
        time.sleep(seconds)  # the rollout's own work (pausing generation, ...): another process
        conn.sendall(b"ok")


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-ms", type=float, default=0.4, help="the trainer's own work during prepare (Python)")
    ap.add_argument("--rollout-ms", type=float, default=0.8, help="the rollout's time to answer")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    proc = mp.get_context("fork").Process(target=_serve, args=(srv, args.rollout_ms / 1e3), daemon=True)
    proc.start()
    cli = socket.create_connection(srv.getsockname())

    def call():
        cli.sendall(b"PrepareSync")
        return cli.recv(64)

    def work():
        t = time.perf_counter()
        while time.perf_counter() - t < args.work_ms / 1e3:
            pass

    pool = ThreadPoolExecutor(4)
    started_first = straggler._submit_then_yield

    def plain(pool, calls):
        return {pool.submit(fn): key for key, fn in calls.items()}

    def one(meanwhile):
        return lambda: straggler.gather(
            pool, {"r": call}, lambda k, s: None, time.monotonic() + 10, meanwhile=meanwhile
        )

    rows = []
    for name, submit, meanwhile in (
        ("no work", started_first, lambda: None),
        ("work, requests out first", started_first, work),
        ("work, plain submit (before)", plain, work),
    ):
        straggler._submit_then_yield = submit
        one(meanwhile)()  # warm-up
        rows.append((name, _median_ms(one(meanwhile), args.reps)))
    straggler._submit_then_yield = started_first
    cli.close()
    proc.join(5)
    print(
        f"rollout {args.rollout_ms} ms, trainer's work {args.work_ms} ms, median of {args.reps}, {os.cpu_count()} CPUs"
    )
    for name, ms in rows:
        print(f"  {name:<30} {ms:.3f} ms")
    from bench.common.results import write_result

    idle = rows[0][1] / 1e3
    write_result(
        "prepare_overlap",
        [{"variant": name, "gather_s": ms / 1e3, "no_work_s": idle} for name, ms in rows],
        baseline={"what": "the same gather with no trainer work, same run", "rows_key": "no_work_s"},
        out=args.out or None,
        device="cpu",
        work_ms=args.work_ms,
        rollout_ms=args.rollout_ms,
        reps=args.reps,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
