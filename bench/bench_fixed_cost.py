"""Fixed cost of a sync — plan, prepare, commit — for a 339-tensor (7B-shaped) layout, on a CPU.

What a sync costs besides moving bytes grows with the number of tensors, not their size, so this
runs a Qwen2 model with 7B's layout (28 layers, 28 heads, 4 KV heads, untied: 339 tensors) at
widths small enough for a CPU (about 1 MB in bf16) through the real services, in this process:
a TrainerApp (hf backend) and a RolloutApp (built-in engine, `--apply-mode inplace`) on loopback
gRPC, TCP bus, checksums on. The bucket size gives about as many buckets as a 7B sync has (15 at
1 GiB), so the commit phase waits only for the last small bucket, as on a GPU.

Timed: the trainer's `SyncReport.phase_seconds` (plan, prepare, stream, commit), median over
`--reps` syncs after `--warmup` (the first sync sends the full manifest; the others its digest),
once per `--paths`: prepare and commit over the rollout's sync link, or as gRPC calls.
Also timed, from the rollout's side: SyncTransaction.prepare and .commit, and how long commit
waited for the last bucket (part of the commit phase, but receive work, not fixed cost); and, as
the floor of the prepare and commit phases (one RPC each), a GetStatus round trip on the same path
and, over the link, an AbortSync of no sync.

    OMP_NUM_THREADS=1 python -m bench fixed_cost --reps 50
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


def round_trips(orch, entry, method: str, request, args) -> list[float]:
    """Seconds of each of `args.reps` calls through the trainer's RPC helper, after `args.warmup`."""
    out = []
    for rep in range(args.warmup + args.reps):
        t0 = time.perf_counter()
        _, err = orch.rollouts.call(entry, method, request)
        if err:
            raise RuntimeError(f"{method} failed: {err}")
        if rep >= args.warmup:
            out.append(time.perf_counter() - t0)
    return out


def run(layout: str, sync_link: bool, args) -> dict:
    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig
    from weightsync.control.client import channel, trainer_stub
    from weightsync.v1 import rollout_pb2, trainer_pb2

    model = str(write_config(layout, tempfile.mkdtemp(prefix=f"fixed-cost-{layout}-")))
    trainer = TrainerApp(
        TrainerConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            backend="hf",
            model=model,
            export_dtype="bfloat16",
            auto_sync_new_rollouts=False,
            sync_link=sync_link,
        )
    )
    rollout = RolloutApp(
        RolloutConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            model=model,
            rollout_id="r0",
            apply_mode="inplace",
            dtype="bfloat16",
        )
    )
    trainer.orch.bucket_bytes = args.bucket_kb << 10  # below the 1 MiB floor of the config: 7B's bucket count
    side = {"rollout_prepare": [], "rollout_commit": [], "commit_waited": []}
    tx = rollout.tx
    tx.prepare = timed(tx.prepare, side["rollout_prepare"])
    commit = timed(tx.commit, side["rollout_commit"])

    def commit_timing_the_wait(sync_id, *a, **k):  # how long commit waits for the last bucket
        p = tx._pending
        t0 = time.perf_counter()
        if p is not None and p.manifest.sync_id == sync_id:
            p.done.wait(timeout=60)
        side["commit_waited"].append(time.perf_counter() - t0)
        return commit(sync_id, *a, **k)

    tx.commit = commit_timing_the_wait

    trainer.start()
    rollout.start()
    ch = channel(trainer.grpc.address)
    try:
        stub = trainer_stub(ch, "", 60)
        stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id="r0", address=rollout.grpc.address))
        phases: dict[str, list[float]] = {}
        for rep in range(args.warmup + args.reps):
            trainer.actor.version += 1
            for v in side.values():
                v.clear()
            report = stub.Sync(trainer_pb2.SyncRequest(transport="tcp"), timeout=120).report
            if not report.ok:
                raise RuntimeError(f"sync failed: {[r.error for r in report.rollouts]}")
            if rep < args.warmup:
                continue
            for k, v in report.phase_seconds.items():
                phases.setdefault(k, []).append(v)
            phases.setdefault("total", []).append(report.seconds)
            phases.setdefault("fixed", []).append(
                sum(report.phase_seconds.get(k, 0.0) for k in ("plan", "prepare", "commit"))
            )
            for k, v in side.items():
                phases.setdefault(k, []).append(sum(v))
        # The floor of a phase: one unary round trip to the rollout on the same path (the trainer's
        # RPC helper, its stub, auth, the rollout's servicer), a GetStatus that does no work; over
        # the sync link, an AbortSync of no sync, the cheapest call it carries.
        entry = trainer.orch.registry.get("r0")
        phases["rpc_round_trip"] = round_trips(trainer.orch, entry, "GetStatus", rollout_pb2.GetStatusRequest(), args)
        if entry.link is not None:
            phases["link_round_trip"] = round_trips(
                trainer.orch, entry, "AbortSync", rollout_pb2.AbortSyncRequest(sync_id="none"), args
            )
        med = {k: statistics.median(v) for k, v in phases.items()}
        p90 = {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in phases.items()}
        return {
            "layout": layout,
            "sync_link": sync_link,
            "num_tensors": report.num_tensors,
            "num_buckets": report.num_buckets,
            "bytes": report.bytes,
            "median_s": med,
            "p90_s": p90,
            "samples": len(phases["total"]),
            "manifest_plans": getattr(getattr(trainer.orch, "manifests", None), "plans", None),
        }
    finally:
        ch.close()
        rollout.stop()
        trainer.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="7b-thin,tiny-thin", help=f"comma list of {','.join(LAYOUTS)}")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-kb", type=int, default=64, help="bucket size (64 KiB: 15 buckets for 7b-thin)")
    ap.add_argument(
        "--paths",
        default="link,grpc",
        help="comma list: link (prepare and commit over the sync link), grpc (as gRPC calls)",
    )
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    out = {
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "results": [],
    }
    runs = [(layout, path) for layout in args.layouts.split(",") if layout for path in args.paths.split(",") if path]
    for layout, path in runs:
        if path not in ("link", "grpc"):
            raise SystemExit(f"--paths: {path!r} is not link or grpc")
        r = run(layout, path == "link", args)
        out["results"].append(r)
        m = r["median_s"]
        link = (
            f", one sync-link round trip (AbortSync) {m['link_round_trip'] * 1e3:.2f} ms"
            if "link_round_trip" in m
            else ""
        )
        print(
            f"{layout} over {path}: {r['num_tensors']} tensors, {r['num_buckets']} buckets, {r['bytes'] / 1e6:.2f} MB; "
            f"median of {r['samples']}: plan {m['plan'] * 1e3:.2f} + prepare {m['prepare'] * 1e3:.2f} + commit "
            f"{m['commit'] * 1e3:.2f} = fixed {m['fixed'] * 1e3:.2f} ms (commit waited {m['commit_waited'] * 1e3:.2f} "
            f"ms for the last bucket); stream {m['stream'] * 1e3:.2f}, total {m['total'] * 1e3:.2f} ms; rollout "
            f"transaction: prepare {m['rollout_prepare'] * 1e3:.2f}, commit {m['rollout_commit'] * 1e3:.2f} ms; "
            f"one unary round trip (GetStatus) {m['rpc_round_trip'] * 1e3:.2f} ms{link}"
        )
    out["loadavg_after"] = os.getloadavg()
    rows = [
        {
            "layout": r["layout"],
            "path": "link" if r["sync_link"] else "grpc",
            "fixed_s": r["median_s"]["fixed"],
            "rpc_round_trip_s": r["median_s"]["rpc_round_trip"],
            **r,
        }
        for r in out.pop("results")
    ]
    baseline = {
        "what": "one unary round trip (GetStatus) to the same rollout on the same path",
        "rows_key": "rpc_round_trip_s",
    }
    write_result("fixed_cost", rows, baseline=baseline, out=args.out or None, device="cpu", **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
