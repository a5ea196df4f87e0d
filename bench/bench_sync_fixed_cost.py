"""Fixed cost of a colocated trainer_writes sync (CUDA IPC, the trainer writing into the engine), on a CPU.

On a GPU a 7B trainer_writes sync is one write pass (the fused copy-and-checksum kernel) plus
what this measures: plan, the PrepareSync round trip (the rollout pauses generation and names its
destination table by id; the trainer lays its own storage out as the buckets meanwhile), the
stream phase's setup around the write pass, and the CommitSync round trip. All of it is host work
and round trips, so it runs here with the GPU boundary faked as tests/support/fake_gpu.py does for
the services tests: a TrainerApp (hf backend) and a RolloutApp (built-in engine, inplace) in this
process, on loopback, sync link on, checksums on, the table shared and mapped once. The trainer's
own storage is sent in place (`flat_buckets`: the path a GPU trainer takes; on a CPU the services
pack instead, so that gate is lifted here), and the write pass is the CPU fallback of the kernel.

Layout: a Qwen2 with 7B's tensor count (339 tensors, bench/bench_fixed_cost.py's `7b-thin`) at a
width a CPU writes in well under a millisecond, in `--bucket-kb` buckets (64 KiB: 18, a 7B sync has 15).
Timed per sync (the trainer's SyncReport): plan, prepare (and its prepare.in_place), stream, the
write pass (stream.trainer_writes), commit; `fixed` = the sync's seconds less its write pass. From
the rollout's side: its PrepareSync and CommitSync handlers (what a round trip costs beyond them is
transport, thread wake-ups and the trainer's own work). `--transports ipc,tcp`: tcp is the same
services' TCP-bus sync (the rollout reads and checks every bucket), for comparison. Both services
share this process (and its GIL): thread hand-offs cost more here than between two processes.

    OMP_NUM_THREADS=1 python bench/bench_sync_fixed_cost.py --reps 40 --rounds 3 --out /tmp/fixed.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_fixed_cost import LAYOUTS, write_config  # noqa: E402

PHASES = ("plan", "prepare", "prepare.in_place", "stream", "stream.trainer_writes", "commit")
#: the whole run's bound: each transport's services start once per round, and a sync takes milliseconds
BUDGET_S = 170.0


def _timed(fn, into: list):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def _in_place_on_cpu() -> None:
    """Let the sync send the actor's own storage on a CPU too (StreamPhase._in_place takes it on a GPU only)."""
    from weightsync.publisher.stream_phase import StreamPhase

    def _in_place(self):
        buffers = self.fleet.actor.flat_buckets(self.manifest)
        if buffers is not None:
            self.session.use_in_place(buffers)
        return buffers

    StreamPhase._in_place = _in_place


def run(transport: str, model: str, args, deadline: float) -> dict:
    from tests.support.fake_gpu import FakeGpu, fake_gpu_boundary
    from tests.support.local_apps import local_fleet
    from weightsync.v1 import trainer_pb2

    gpu = FakeGpu()
    fleet = local_fleet(
        {"r0": {"apply_mode": "inplace", "model": model, "dtype": "bfloat16"}},
        model=model,
        export_dtype="bfloat16",
        param_dtype="bfloat16",  # the export as it is: the actor's storage is the buckets (flat_buckets)
    )
    with fleet as (trainer, rollouts, stub):
        app = rollouts["r0"]
        fake_gpu_boundary(trainer, app, gpu)
        trainer.orch.bucket_bytes = args.bucket_kb << 10  # below the config's 1 MiB floor: 7B's bucket count
        side: dict[str, list[float]] = {"rollout.PrepareSync": [], "rollout.CommitSync": []}
        app.servicer.PrepareSync = _timed(app.servicer.PrepareSync, side["rollout.PrepareSync"])
        app.servicer.CommitSync = _timed(app.servicer.CommitSync, side["rollout.CommitSync"])
        request = trainer_pb2.SyncRequest(transport=transport)
        if transport == "ipc":
            request.ipc_direction = "trainer_writes"
        samples: dict[str, list[float]] = {}
        for rep in range(args.warmup + args.reps):
            if time.monotonic() > deadline:
                break
            trainer.actor.version += 1
            for v in side.values():
                v.clear()
            t0 = time.perf_counter()
            report = stub.Sync(request, timeout=60).report
            wall = time.perf_counter() - t0
            if not report.ok:
                raise RuntimeError(f"{transport} sync failed: {[r.error for r in report.rollouts]}")
            if transport == "ipc" and "stream.trainer_writes" not in report.phase_seconds:
                raise RuntimeError("the ipc sync did not run trainer_writes")
            if rep < args.warmup:
                continue
            ph = report.phase_seconds
            row = {k: ph.get(k, 0.0) for k in PHASES}
            row["seconds"] = report.seconds
            # ipc: all but the write pass; tcp (whose stream is the bus): plan, prepare and commit
            row["fixed"] = (
                report.seconds - ph.get("stream.trainer_writes", 0.0)
                if transport == "ipc"
                else sum(ph.get(k, 0.0) for k in ("plan", "prepare", "commit"))
            )
            row["stream.rest"] = ph.get("stream", 0.0) - ph.get("stream.trainer_writes", 0.0)
            row["wall"] = wall
            row.update({k: sum(v) for k, v in side.items()})
            for k, v in row.items():
                samples.setdefault(k, []).append(v)
        return {
            "transport": transport,
            "num_tensors": report.num_tensors,
            "num_buckets": report.num_buckets,
            "bytes": report.bytes,
            "samples": len(samples.get("seconds", [])),
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
            "raw_s": samples,
            "table_shares": gpu.shares,
            "table_opens": gpu.opens,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="7b-thin", choices=sorted(LAYOUTS))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="each transport's services started this many times")
    ap.add_argument("--bucket-kb", type=int, default=64)
    ap.add_argument("--transports", default="ipc,tcp", help="comma list of ipc (trainer_writes), tcp")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    _in_place_on_cpu()
    deadline = time.monotonic() + BUDGET_S
    model = write_config(args.layout, tempfile.mkdtemp(prefix=f"sync-fixed-cost-{args.layout}-"))
    out = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime()),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "layout": args.layout,
        "results": [],
    }
    transports = [t for t in args.transports.split(",") if t]
    for t in transports:
        if t not in ("ipc", "tcp"):
            raise SystemExit(f"--transports: {t!r} is not ipc or tcp")
    for rnd in range(args.rounds):
        for t in transports:
            if time.monotonic() > deadline:
                print(f"stopped at round {rnd + 1}: the {BUDGET_S:.0f} s budget is spent")
                break
            r = run(t, model, args, deadline)
            r["round"] = rnd + 1
            out["results"].append(r)
            m = r["median_ms"]
            print(
                f"round {rnd + 1} {t}: {r['num_tensors']} tensors, {r['num_buckets']} buckets; median of "
                f"{r['samples']} (ms): "
                + " ".join(f"{k} {m[k]:.3f}" for k in (*PHASES, "stream.rest", "fixed", "seconds", "wall"))
                + f"; rollout handlers: PrepareSync {m['rollout.PrepareSync']:.3f}, "
                f"CommitSync {m['rollout.CommitSync']:.3f}"
            )
    by_t: dict[str, dict[str, list[float]]] = {}
    for r in out["results"]:
        for k, v in r["median_ms"].items():
            by_t.setdefault(r["transport"], {}).setdefault(k, []).append(v)
    out["median_of_rounds_ms"] = {t: {k: statistics.median(v) for k, v in d.items()} for t, d in by_t.items()}
    for t, d in out["median_of_rounds_ms"].items():
        print(f"{t}, median of the rounds' medians (ms): " + " ".join(f"{k} {v:.3f}" for k, v in d.items()))
    out["loadavg_after"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
