"""The control plane of a sync at full scale, on a CPU: the manifests of Qwen3-235B-A22B, DeepSeek-V3 and
Kimi-K2 (bf16 and block FP8, from bench/model_arch.py's configs; metadata only) through the services' own
control code, with a byte path that carries nothing.

Per sync, as the services run it (each message encoded and parsed as the wire would, so the protobuf cost
is counted; the two sides share this process, no socket):
- plan     the trainer's SyncOrchestrator._plan (export format, ManifestCache: the layout planned and
           digested once, then reused);
- prepare  the PrepareSync request as SyncAttempt builds it (the full manifest the first time, the layout
           digest after; a rollout that answers `manifest_needed` is sent the full one), the rollout's
           RolloutServicer.PrepareSync (limits, KnownLayouts, the transaction's validation against the
           engine, block-FP8 pairing of every weight with its scale), the answer parsed back;
- write    the byte path: the rollout hands its engine to a trainer that writes it (the ipc
           trainer_writes hand-off, SyncTransaction.accept_trainer_writes); nothing is written;
- commit   CommitSyncRequest with one checksum per bucket, RolloutServicer.CommitSync, the answer;
- report   the trainer's SyncReport and metrics (SyncOrchestrator._report);
- status   RolloutServicer.GetStatus, encoded.
The engine holds the model's parameters as metadata alone (MetaEngine): a built-in-engine rollout
serving bf16, so a block-FP8 sync is paired and checked for dequantization.

`first_s` is the first sync (layout planned, full manifest, validated); `steady_s` the median of the
next `--syncs`; `rejoin_s` a sync to a rollout that restarted (its layouts lost: the digest is answered
`manifest_needed`, then the full manifest). Each phase's median in `phases` (steady) and
`first_phases`. The full manifest goes with run entries (weightsync/bus/runs.py: a layer's experts as
one entry), as to any rollout that reads them; `plain_first_s` / `plain_rejoin_s` are the same syncs with
every tensor its own entry (a rollout that predates runs), in the same run (`--no-plain` skips them).
`*_cpu_s`: this process's CPU seconds of the same syncs (a shared host's other tenants count in the wall
times, not in these).

    OMP_NUM_THREADS=1 python bench/control_plane.py            # writes bench/results/control_plane_cpu_<date>[-N].json
    OMP_NUM_THREADS=1 python bench/control_plane.py --models kimi-k2 --dtypes fp8-block --profile /tmp/k2.prof
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import shlex
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # `python bench/control_plane.py` from anywhere
    sys.path.insert(0, str(ROOT))

MODELS = ("qwen3-235b-a22b", "deepseek-v3", "kimi-k2")
DTYPES = ("bf16", "fp8-block")
BUCKET_MB = 1024  # the trainer's default bucket_mb


class _Context:
    """A grpc.ServicerContext for direct calls: an abort raises, naming the code; the callbacks a handler adds
    for after its answer went out (the rollout's log lines) run at `answered()`, as gRPC runs them after the
    reply, so they stay out of the handler's time as they do on the wire."""

    def __init__(self):
        self._after: list = []

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")

    def add_callback(self, fn) -> bool:
        self._after.append(fn)
        return True

    def answered(self):
        for fn in self._after:
            fn()


def meta_engine(metas):
    """A rollout engine whose parameters are metadata alone (name -> TensorMeta)."""
    from rollout_svc.engine.base import Engine

    class MetaEngine(Engine):
        def __init__(self):
            self._metas = {m.name: m for m in metas}
            self._numel = sum(_numel(m.shape) for m in metas)

        def param_metas(self):
            return self._metas

        def load_weights(self, named):
            for _ in named:
                pass

        def flush_cache(self):
            pass

        def generate(self, prompts, sampling, step=None):
            raise NotImplementedError("the control-plane bench generates nothing")

        def score(self, token_ids, prompt_length):
            raise NotImplementedError("the control-plane bench scores nothing")

        def num_ranks(self):
            return 1

        def num_parameters(self):
            return self._numel

        def prefix_cache_entries(self):
            return 0

    return MetaEngine()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_metas(name: str, dtype):
    """The trainer's export metadata of `name` (HF names and shapes, one dtype)."""
    from bench.control_names import named_tensors
    from bench.model_arch import arch
    from weightsync.bus.plan import TensorMeta

    return [TensorMeta(n, tuple(t.shape), dtype) for n, t in named_tensors(arch(name))]


class Pair:
    """One trainer (SyncOrchestrator and its layout cache) and one rollout (RolloutServicer,
    SyncTransaction inplace, MetaEngine) of `metas`, joined by direct calls."""

    def __init__(self, metas, export_dtype: str, bucket_bytes: int, family: str = "bench", runs: bool = True):
        import torch
        from prometheus_client import CollectorRegistry

        from weightsync.obs.metrics import SyncMetrics
        from weightsync.publisher.declared import DeclaredSource
        from weightsync.publisher.export_format import actor_dtype
        from weightsync.publisher.orchestrator import SyncOrchestrator
        from weightsync.publisher.registry import RolloutRegistry
        from weightsync.sync_options import SyncOptions

        plain = [type(m)(m.name, m.shape, actor_dtype(export_dtype)) for m in metas]
        self.actor = DeclaredSource(plain, family, torch.device("cpu"))
        self.actor.version = 1
        registry = RolloutRegistry("token", 30.0)
        self.entry = registry.upsert("rollout-0", "127.0.0.1:1")
        self.orch = SyncOrchestrator(
            self.actor,
            threading.Lock(),
            registry,
            SyncMetrics("trainer", CollectorRegistry()),
            token="token",
            options=SyncOptions(
                transport="tcp",
                bucket_bytes=bucket_bytes,
                sync_timeout_s=300.0,
                rpc_timeout_s=30.0,
                export_dtype=export_dtype,
                sync_link=False,
            ),
            origin="bench-trainer",
        )
        engine_metas = [type(m)(m.name, m.shape, torch.bfloat16) for m in metas]
        self.rollout_from = lambda: self._rollout(engine_metas, family, bucket_bytes)
        self.servicer = self.rollout_from()
        # runs=False: the trainer treats the rollout as one that predates run entries (every tensor an entry)
        self.runs = runs
        self.entry.manifest_runs = runs and self.servicer.status().manifest_runs  # as registry.poll learns it

    @staticmethod
    def _rollout(metas, family, bucket_bytes):
        from prometheus_client import CollectorRegistry

        from rollout_svc.limits import LimitsConfig
        from rollout_svc.service import RolloutServicer
        from rollout_svc.sync.transaction import SyncTransaction
        from weightsync.obs.metrics import SyncMetrics

        engine = meta_engine(metas)
        tx = SyncTransaction(engine, "inplace")
        limits = LimitsConfig(max_bucket_mb=16384)  # an embedding is a bucket alone: 2.3 GB for Kimi-K2
        return RolloutServicer(
            "rollout-0",
            engine,
            tx,
            SyncMetrics("rollout", CollectorRegistry()),
            "builtin",
            family,
            "127.0.0.1:1",
            300.0,
            limits=limits,
        )

    def sync(self, clock) -> tuple[int, int]:
        """One sync through the control path; (tensors, buckets)."""
        from weightsync.publisher.phases import PhaseClock
        from weightsync.v1 import trainer_pb2

        orch, entry, rollout = self.orch, self.entry, self.servicer
        self.actor.version += 1
        t0, c0 = time.perf_counter(), time.process_time()
        with clock("plan"):
            _, manifest = orch._plan([], "tcp")
        with clock("prepare"):
            self._prepare(manifest)
        with clock("write"):
            rollout.tx.accept_trainer_writes(manifest.sync_id)  # the byte path: nothing written
        with clock("commit"):
            version = self._commit(manifest)
        with clock("report"):
            report = trainer_pb2.SyncReport(
                sync_id=manifest.sync_id,
                version=manifest.version,
                transport="tcp",
                bytes=manifest.total_bytes,
                num_buckets=len(manifest.buckets),
                num_tensors=manifest.num_tensors,
            )
            result = trainer_pb2.RolloutSyncResult(rollout_id=entry.rollout_id, ok=True, version=version)
            orch._report(report, {entry.rollout_id: result}, {entry.rollout_id: entry}, manifest, PhaseClock(), 0.001)
        with clock("status"):
            rollout.GetStatus(None, _Context()).SerializeToString()
        clock.total(time.perf_counter() - t0, time.process_time() - c0)
        return report.num_tensors, report.num_buckets

    def _prepare(self, manifest) -> None:
        """PrepareSync as SyncAttempt sends it: the layout's digest to a rollout known to hold it, else
        the full manifest; a `manifest_needed` answer is sent the full one."""
        from weightsync.bus.layout import compact_proto
        from weightsync.v1 import bus_pb2, rollout_pb2

        cache, entry, digest = self.orch.manifests, self.entry, manifest.layout_digest
        sent_full = not cache.holds(entry, digest)
        while True:
            req = rollout_pb2.PrepareSyncRequest(
                manifest=cache.full_proto(manifest, runs=entry.manifest_runs) if sent_full else compact_proto(manifest),
                timeout_seconds=300.0,
                transport=bus_pb2.TransportSpec(tcp=bus_pb2.TcpTransport()),
            )
            wire = req.SerializeToString()
            ctx = _Context()
            got = self.servicer.PrepareSync(rollout_pb2.PrepareSyncRequest.FromString(wire), ctx)
            resp = rollout_pb2.PrepareSyncResponse.FromString(got.SerializeToString())
            ctx.answered()
            entry.manifest_runs = self.runs and resp.manifest_runs
            if not resp.manifest_needed:
                break
            if sent_full:
                raise RuntimeError("the rollout asked for the full manifest it was just sent")
            cache.forget(entry)
            sent_full = True
        cache.learned(entry, digest)

    def _commit(self, manifest) -> int:
        """CommitSync with one checksum per bucket (the trainer's of what it wrote); the committed version."""
        from weightsync.v1 import rollout_pb2

        req = rollout_pb2.CommitSyncRequest(sync_id=manifest.sync_id, version=manifest.version)
        for b in manifest.buckets:
            req.checksums.add(index=b.index, checksum=b.index)
        wire = req.SerializeToString()
        ctx = _Context()
        got = self.servicer.CommitSync(rollout_pb2.CommitSyncRequest.FromString(wire), ctx)
        resp = rollout_pb2.CommitSyncResponse.FromString(got.SerializeToString())
        ctx.answered()
        if resp.version != manifest.version:
            raise RuntimeError(f"committed version {resp.version}, expected {manifest.version}")
        return resp.version


_TOTALS = ("total", "cpu")  # a sync's wall and CPU seconds, not phases


class Clock:
    """Per-phase seconds of each sync, then their medians."""

    def __init__(self):
        self.syncs: list[dict[str, float]] = []

    def start(self) -> None:
        self.syncs.append({})

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.syncs[-1][phase] = self.syncs[-1].get(phase, 0.0) + time.perf_counter() - t0

    def total(self, seconds: float, cpu: float) -> None:
        self.syncs[-1]["total"] = seconds
        # this process's CPU seconds: on a shared host the wall time also counts the other tenants' turns
        self.syncs[-1]["cpu"] = cpu

    def medians(self, syncs) -> dict[str, float]:
        return {k: round(statistics.median(s[k] for s in syncs), 6) for k in syncs[0]}


def measure(model: str, dtype: str, syncs: int, bucket_bytes: int, profile: str = "", plain: bool = True) -> dict:
    import torch

    metas = model_metas(model, torch.bfloat16)
    export = "bf16" if dtype == "bf16" else dtype
    pair = Pair(metas, export, bucket_bytes)
    clock = Clock()
    clock.start()
    tensors, buckets = pair.sync(clock)
    first = clock.syncs[0]
    prof = cProfile.Profile() if profile else None
    for _ in range(syncs):
        clock.start()
        if prof:
            prof.enable()
        pair.sync(clock)
        if prof:
            prof.disable()
    if prof:
        prof.dump_stats(profile)
    steady = clock.medians(clock.syncs[1:])
    # a restarted rollout: the trainer still holds the layout, the rollout no longer does
    pair.servicer = pair.rollout_from()
    clock.start()
    pair.sync(clock)
    rejoin = clock.syncs[-1]
    row = {
        "model": model,
        "dtype": dtype,
        "tensors": tensors,
        "buckets": buckets,
        "bucket_bytes": bucket_bytes,
        "first_s": round(first["total"], 6),
        "steady_s": steady["total"],
        "rejoin_s": round(rejoin["total"], 6),
        "first_cpu_s": round(first["cpu"], 6),
        "steady_cpu_s": steady["cpu"],
        "rejoin_cpu_s": round(rejoin["cpu"], 6),
        "phases": {k: v for k, v in steady.items() if k not in _TOTALS},
        "first_phases": {k: round(v, 6) for k, v in first.items() if k not in _TOTALS},
        "steady_syncs": syncs,
    }
    if plain:
        del pair, prof  # the baseline's collector passes must not walk this pair's objects too
        gc.collect()
        row.update(_plain(metas, export, bucket_bytes))
    return row


def _plain(metas, export: str, bucket_bytes: int) -> dict:
    """The first sync and a restarted rollout's with every tensor its own manifest entry (as a rollout that
    predates run entries is sent): the baseline of the same run."""
    pair = Pair(metas, export, bucket_bytes, runs=False)
    clock = Clock()
    clock.start()
    pair.sync(clock)
    pair.servicer = pair.rollout_from()
    clock.start()
    pair.sync(clock)
    first, rejoin = clock.syncs
    return {
        "plain_first_s": round(first["total"], 6),
        "plain_rejoin_s": round(rejoin["total"], 6),
        "plain_first_cpu_s": round(first["cpu"], 6),
        "plain_rejoin_cpu_s": round(rejoin["cpu"], 6),
        "plain_first_phases": {k: round(v, 6) for k, v in first.items() if k not in _TOTALS},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma-separated, any of bench/model_arch.py (default: the three large ones)",
    )
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of bf16, fp8-block")
    p.add_argument("--syncs", type=int, default=10, help="steady-state syncs per configuration (median)")
    p.add_argument("--bucket-mb", type=int, default=BUCKET_MB)
    p.add_argument("--out", default="", help="result JSON (default bench/results/control_plane_cpu_<date>.json)")
    p.add_argument("--profile", default="", help="cProfile the steady-state syncs of the last configuration here")
    p.add_argument(
        "--no-plain", action="store_true", help="skip the baseline: first and restarted syncs with plain manifests"
    )
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    configs = [(m, d) for m in args.models.split(",") for d in args.dtypes.split(",")]
    for i, (model, dtype) in enumerate(configs):
        last = i == len(configs) - 1
        row = measure(model, dtype, args.syncs, args.bucket_mb << 20, args.profile if last else "", not args.no_plain)
        rows.append(row)
        base = ""
        if not args.no_plain:
            base = (
                f"  (plain: first {row['plain_first_s']:.3f} s rejoin {row['plain_rejoin_s']:.3f} s; CPU: first "
                f"{row['first_cpu_s']:.3f} / {row['plain_first_cpu_s']:.3f} s, rejoin {row['rejoin_cpu_s']:.3f} / "
                f"{row['plain_rejoin_cpu_s']:.3f} s)"
            )
        print(
            f"{model:16s} {dtype:9s} {row['tensors']:7d} tensors {row['buckets']:5d} buckets  "
            f"first {row['first_s']:.3f} s  steady {row['steady_s'] * 1e3:.2f} ms  rejoin {row['rejoin_s']:.3f} s  "
            + " ".join(f"{k} {v * 1e3:.2f}" for k, v in row["phases"].items())
            + base,
            flush=True,
        )
    from bench.common.results import write_result

    baseline = None
    if not args.no_plain:
        baseline = {
            "what": "the same first and restarted-rollout syncs with plain manifests (every tensor an entry, as "
            "a rollout that predates run entries is sent), measured in this run",
            "rows_key": "plain_first_s",
        }
    write_result(
        "control_plane",
        rows,
        baseline,
        command="OMP_NUM_THREADS=1 python bench/control_plane.py " + shlex.join(argv or sys.argv[1:]),
        out=args.out or None,
        device="cpu",
        # a shared host's load scales every absolute time: compare rows of one run
        loadavg_before=[round(x, 2) for x in load_before],
        loadavg_after=[round(x, 2) for x in os.getloadavg()],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
