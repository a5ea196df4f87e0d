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

Layout: a Qwen2 with 7B's tensor count (339 tensors, bench/common/models.py's `7b-thin`) at a
width a CPU writes in well under a millisecond, in `--bucket-kb` buckets (64 KiB: 18, a 7B sync has 15).
Timed per sync (the trainer's SyncReport): plan, prepare (and its prepare.in_place), stream, the
write pass (stream.trainer_writes), commit; `fixed` = the sync's seconds less its write pass. From
the rollout's side: its PrepareSync and CommitSync handlers (what a round trip costs beyond them is
transport, thread wake-ups and the trainer's own work). `--transports ipc,tcp`: tcp is the same
services' TCP-bus sync (the rollout reads and checks every bucket), for comparison. Both services
share this process (and its GIL): thread hand-offs cost more here than between two processes.

    OMP_NUM_THREADS=1 python -m bench sync_fixed_cost --reps 40 --rounds 3
    OMP_NUM_THREADS=1 python -m bench sync_fixed_cost --ab --ab-what fixed-work --rollout inline  # A/B, 2026-11-28
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common.models import LAYOUTS, write_config  # noqa: E402
from bench.common.results import write_result  # noqa: E402
from bench.common.timing import timed  # noqa: E402

PHASES = ("plan", "prepare", "prepare.in_place", "stream", "stream.trainer_writes", "commit")
#: the whole run's bound: each transport's services start once per round, and a sync takes milliseconds
BUDGET_S = 170.0


def _in_place_on_cpu() -> None:
    """Let the sync send the actor's own storage on a CPU too (StreamPhase._in_place takes it on a GPU only)."""
    from weightsync.publisher.stream_phase import StreamPhase

    def _in_place(self):
        buffers = self.fleet.actor.flat_buckets(self.manifest)
        if buffers is not None:
            self.session.use_in_place(buffers)
        return buffers

    StreamPhase._in_place = _in_place


#: --ab: every other sync prepares as before 2026-11-26 (the call on an RPC thread, `gather`), set per sync
_THREADED = [False]


def _ab_prepare() -> None:
    """Let `_THREADED` send a sync's PrepareSync from the RPC pool as before (straggler.gather), for A/B
    runs in the same services: the two variants alternate sync by sync, under the same load."""
    from weightsync.publisher.attempt import SyncAttempt

    one_thread = SyncAttempt._prepare_answers

    def _prepare_answers(self, calls, meanwhile):
        if not _THREADED[0]:
            return one_thread(self, calls, meanwhile)
        return self._gather(
            "prepare",
            {e.rollout_id: self._prepare_call(e, req) for e, req in calls},
            meanwhile,
            on_late=self._late_prepare,
        )

    SyncAttempt._prepare_answers = _prepare_answers


def _ab_fixed_work() -> None:
    """Let `_THREADED` (every other sync) run the per-sync work removed on 2026-11-28, for an A/B in the same
    services: the pipeline's producer on a thread started for the sync (tcp; the CPU's ipc trainer_writes
    sends its buckets at once, with no producer), and the rollout's state metric written series by series
    (a rollout in this process only: `--rollout inline`)."""
    import threading

    from rollout_svc.service import RolloutServicer
    from weightsync.bus import pipeline
    from weightsync.v1 import rollout_pb2

    kept = pipeline.PRODUCERS

    class _ThreadPerSync:
        @staticmethod
        def submit(fn):
            if not _THREADED[0]:
                return kept.submit(fn)
            t = threading.Thread(target=fn, name="pack-per-sync", daemon=True)
            t.start()
            return t

    pipeline.PRODUCERS = _ThreadPerSync()
    changed_only = RolloutServicer.refresh_state_metric

    def refresh_state_metric(self):
        if not _THREADED[0]:
            return changed_only(self)
        for name, num in rollout_pb2.EngineState.items():
            if num:
                self.rollout_metrics.set_state(name, self.tx.state == num)
        self.metrics.version.set(self.tx.version)
        self.metrics.in_progress.set(1 if self.tx.pending_sync_id else 0)

    RolloutServicer.refresh_state_metric = refresh_state_metric


def _ab_logs() -> None:
    """Let `_THREADED` (every other sync) write its log lines as before 2026-11-28 (3): the rollout's
    "prepared" and "committed" lines inside the PrepareSync and CommitSync handlers, not after their
    answers, and the trainer's opening line at INFO. The services log at INFO, to a file here."""
    from rollout_svc import service
    from weightsync.publisher import orchestrator

    after_answer = service._after_answer

    def _after_answer(context, fn):
        if _THREADED[0]:
            return fn()
        return after_answer(context, fn)

    service._after_answer = _after_answer
    quiet = orchestrator.log

    class _Opening:
        def __getattr__(self, name):
            return getattr(quiet, name)

        def debug(self, *a, **k):
            (quiet.info if _THREADED[0] else quiet.debug)(*a, **k)

    orchestrator.log = _Opening()


def _ab_early_commit() -> None:
    """Let `_THREADED` (every other sync) send CommitSync after the stream as before 2026-11-28 (3), not
    as the last bucket goes out (tcp, nccl: weightsync/publisher/early_commit.py)."""
    from weightsync.publisher.stream_phase import StreamPhase

    early = StreamPhase._commit_early

    def _commit_early(self, channel, checksums):
        if not _THREADED[0]:
            early(self, channel, checksums)

    StreamPhase._commit_early = _commit_early


#: --ab-what -> what makes every other sync run as before
AB = {"prepare": _ab_prepare, "fixed-work": _ab_fixed_work, "logs": _ab_logs, "early-commit": _ab_early_commit}


class _SharedMemoryGpu:
    """The GPU boundary between two processes on a CPU: each engine parameter moved into a file of its
    own in /dev/shm, mapped shared, stands for its CUDA allocation, and the file's path for its IPC handle."""

    GPU = "GPU-shm-0"

    def __init__(self):
        self.paths: dict[int, str] = {}  # storage address -> its file

    def move_into_files(self, params) -> None:
        import torch

        with torch.no_grad():
            for p in params:
                path = f"/dev/shm/ws-bench-fixed-cost-{os.getpid()}-{len(self.paths)}"
                nbytes = p.numel() * p.element_size()
                storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
                mapped = torch.empty(0, dtype=p.dtype).set_(storage).view(p.shape)
                mapped.copy_(p)
                p.set_(mapped)  # in place: the engine keeps the same tensors, now in the file
                self.paths[p.untyped_storage().data_ptr()] = path

    def share(self, t):
        from weightsync.v1 import bus_pb2

        storage = t.untyped_storage()
        path = self.paths[storage.data_ptr()]
        return bus_pb2.CudaIpcHandle(handle=path.encode(), storage_size=storage.nbytes(), device_uuid=self.GPU)

    @staticmethod
    def open(h):
        import torch

        storage = torch.UntypedStorage.from_file(bytes(h.handle).decode(), shared=True, nbytes=h.storage_size)
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def remove(self) -> None:
        for path in self.paths.values():
            try:
                os.unlink(path)
            except OSError:
                pass


def _rollout_process(model: str, conn) -> None:
    """A rollout-svc of its own (a child process): its engine's parameters in shared memory, offered as
    the destination table; sends its address, then its handlers' timings when told to stop."""
    logging.basicConfig(level=logging.WARNING)
    from tests.support.local_apps import start_rollout

    app = start_rollout("r0", apply_mode="inplace", model=model, dtype="bfloat16")
    gpu = _SharedMemoryGpu()
    try:
        gpu.move_into_files([p for _, p in app.engine.named_weights()])
        app.servicer.ipc.check = lambda spec: gpu.GPU if spec.device_uuid == gpu.GPU else "GPU-other"
        app.servicer.ipc.share_fn = gpu.share
        side: dict[str, list[float]] = {"rollout.PrepareSync": [], "rollout.CommitSync": []}
        app.servicer.PrepareSync = timed(app.servicer.PrepareSync, side["rollout.PrepareSync"])
        app.servicer.CommitSync = timed(app.servicer.CommitSync, side["rollout.CommitSync"])
        conn.send(app.grpc.address)
        conn.recv()  # stop
        conn.send(side)
    finally:
        app.stop()
        gpu.remove()


def run(transport: str, model: str, args, deadline: float, separate: bool) -> dict:
    """One services run of `transport`; `separate`: the rollout in a process of its own (as deployed),
    else in this one (tests/support/fake_gpu.py's boundary, one GIL for both services)."""
    import multiprocessing as mp

    from tests.support.fake_gpu import FakeGpu, fake_gpu_boundary
    from tests.support.local_apps import local_fleet, start_trainer
    from weightsync.v1 import trainer_pb2

    gpu = FakeGpu()
    trainer_fields = {"model": model, "export_dtype": "bfloat16", "param_dtype": "bfloat16"}
    side: dict[str, list[float]] = {"rollout.PrepareSync": [], "rollout.CommitSync": []}
    child = conn = None
    if separate:
        from weightsync.control.client import channel, trainer_stub

        conn, theirs = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=_rollout_process, args=(model, theirs), daemon=True)
        child.start()
        theirs.close()  # the child's end: a child that dies closes the pipe, and recv says so
        if not conn.poll(120):
            raise RuntimeError("the rollout process did not start within 120 s")
        try:
            address = conn.recv()
        except EOFError:
            raise RuntimeError(f"the rollout process failed to start (exit code {child.exitcode})") from None
        trainer = start_trainer(**trainer_fields)
        ipc = trainer.orch.transports["ipc"]
        ipc.needs_cuda, ipc.uuid_of, ipc.open_fn = False, (lambda d: _SharedMemoryGpu.GPU), _SharedMemoryGpu.open
        stub = trainer_stub(channel(trainer.grpc.address), "", 60)
        stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id="r0", address=address))
    else:
        fleet = local_fleet({"r0": {"apply_mode": "inplace", "model": model, "dtype": "bfloat16"}}, **trainer_fields)
        trainer, rollouts, stub = fleet.__enter__()
        app = rollouts["r0"]
        fake_gpu_boundary(trainer, app, gpu)
        app.servicer.PrepareSync = timed(app.servicer.PrepareSync, side["rollout.PrepareSync"])
        app.servicer.CommitSync = timed(app.servicer.CommitSync, side["rollout.CommitSync"])
    try:
        trainer.orch.bucket_bytes = args.bucket_kb << 10  # below the config's 1 MiB floor: 7B's bucket count
        request = trainer_pb2.SyncRequest(transport=transport)
        if transport == "ipc":
            request.ipc_direction = "trainer_writes"
        samples: dict[str, list[float]] = {}
        for rep in range(args.warmup + args.reps):
            if time.monotonic() > deadline:
                break
            trainer.actor.version += 1
            variant = "before" if args.ab and rep % 2 else ""
            _THREADED[0] = bool(variant)
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
            for k, v in row.items():
                samples.setdefault(f"{variant}:{k}" if variant else k, []).append(v)
    finally:
        _THREADED[0] = False
        if separate:
            trainer.stop()
            conn.send("stop")
            if conn.poll(30):
                side = conn.recv()
            child.join(30)
        else:
            fleet.__exit__(None, None, None)
    n = len(samples.get("seconds", [])) + len(samples.get("before:seconds", []))
    for k, v in side.items():
        last = v[-n:] if n else []  # one call each per sync: the timed syncs' are the last n
        if args.ab:  # the timed syncs alternate after, before, ...
            first = args.warmup % 2  # the variant of the first timed sync: 0 after, 1 before
            samples[k] = last[first::2]
            samples[f"before:{k}"] = last[1 - first :: 2]
        else:
            samples[k] = last
    return {
        "transport": transport,
        "rollout": "own process" if separate else "this process",
        "num_tensors": report.num_tensors,
        "num_buckets": report.num_buckets,
        "bytes": report.bytes,
        "samples": n,
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items() if v},
        "raw_s": samples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="7b-thin", choices=sorted(LAYOUTS))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="each run's services started this many times")
    ap.add_argument("--bucket-kb", type=int, default=64)
    ap.add_argument("--transports", default="ipc,tcp", help="comma list of ipc (trainer_writes), tcp")
    ap.add_argument(
        "--rollout", default="process,inline", help="comma list: process (its own, as deployed), inline (this one)"
    )
    ap.add_argument(
        "--ab",
        action="store_true",
        help="every other sync runs as before (--ab-what): both variants in the same services, sync by sync",
    )
    ap.add_argument(
        "--ab-what",
        default="prepare",
        choices=sorted(AB),
        help="--ab's before: prepare (PrepareSync on an RPC thread, 2026-11-26), fixed-work (a producer thread "
        "started per sync and the state metric written series by series, 2026-11-28; --rollout inline), logs "
        "(the sync's INFO lines inside the round trips; --rollout inline; logs at INFO to a file) or early-commit "
        "(CommitSync after the stream, tcp)",
    )
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    if args.ab and args.ab_what == "logs":  # the services' own level, written where a deployment writes them
        log_file = tempfile.NamedTemporaryFile(prefix="sync-fixed-cost-", suffix=".log", delete=False).name
        logging.basicConfig(level=logging.INFO, filename=log_file)
        print(f"services log at INFO to {log_file}")
    else:
        logging.basicConfig(level=logging.WARNING)

    _in_place_on_cpu()
    if args.ab:
        AB[args.ab_what]()
    deadline = time.monotonic() + BUDGET_S
    model = str(write_config(args.layout, tempfile.mkdtemp(prefix=f"sync-fixed-cost-{args.layout}-")))
    out = {
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "layout": args.layout,
        "results": [],
    }
    runs = [(t, r) for t in args.transports.split(",") if t for r in args.rollout.split(",") if r]
    for t, r in runs:
        if t not in ("ipc", "tcp") or r not in ("process", "inline"):
            raise SystemExit(f"--transports {t!r} / --rollout {r!r}: ipc or tcp / process or inline")
    for rnd in range(args.rounds):
        for t, where in runs:
            if time.monotonic() > deadline:
                print(f"stopped in round {rnd + 1}: the {BUDGET_S:.0f} s budget is spent")
                break
            r = run(t, model, args, deadline, separate=where == "process")
            r["round"] = rnd + 1
            out["results"].append(r)
            m = r["median_ms"]
            print(
                f"round {rnd + 1} {t}, rollout {where}: {r['num_tensors']} tensors, {r['num_buckets']} buckets; "
                f"median of {r['samples']} (ms): "
                + " ".join(f"{k} {m[k]:.3f}" for k in (*PHASES, "stream.rest", "fixed", "seconds", "wall") if k in m)
                + f"; rollout handlers: PrepareSync {m.get('rollout.PrepareSync', 0):.3f}, "
                f"CommitSync {m.get('rollout.CommitSync', 0):.3f}"
            )
            if args.ab:
                print(
                    f"   every other sync, as before ({args.ab_what}): "
                    + " ".join(
                        f"{k} {m['before:' + k]:.3f}" for k in ("prepare", "fixed", "seconds") if "before:" + k in m
                    )
                    + f"; rollout PrepareSync {m.get('before:rollout.PrepareSync', 0):.3f}"
                )
    by_run: dict[str, dict[str, list[float]]] = {}
    for r in out["results"]:
        for k, v in r["median_ms"].items():
            by_run.setdefault(f"{r['transport']}, rollout {r['rollout']}", {}).setdefault(k, []).append(v)
    out["median_of_rounds_ms"] = {t: {k: statistics.median(v) for k, v in d.items()} for t, d in by_run.items()}
    for t, d in out["median_of_rounds_ms"].items():
        print(f"{t}: median of the rounds' medians (ms): " + " ".join(f"{k} {v:.3f}" for k, v in d.items()))
    out["loadavg_after"] = os.getloadavg()
    rows = [
        {"fixed_s": r["median_ms"]["fixed"] / 1e3, "sync_s": r["median_ms"]["seconds"] / 1e3, **r}
        for r in out.pop("results")
    ]
    # no bound in the same run: the fixed cost is host work and round trips (bench fixed_cost and rpc_floor time
    # those); with --ab, the other variant's syncs in the same services are the baseline
    baseline = None
    if args.ab:
        for row in rows:
            m = row["median_ms"]
            row["before_fixed_s"], row["before_sync_s"] = m["before:fixed"] / 1e3, m["before:seconds"] / 1e3
        baseline = {"what": f"every other sync as before ({args.ab_what}), same services", "rows_key": "before_fixed_s"}
    write_result("sync_fixed_cost", rows, baseline=baseline, out=args.out or None, device="cpu", **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
