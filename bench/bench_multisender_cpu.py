"""Multi-sender vs the rank-0 funnel, on one CPU machine, with each sender's link throttled.

A torchrun megatron trainer (gloo, PP=`--pp`) and `--rollouts` rollouts run as real services. Each
rollout's data port sits behind a BusProxy (tests/support/bus_proxy.py) that paces every trainer
rank's bytes to `--rate-mb` MB/s across all its connections, as if each rank had its own NIC of
that speed. Then, in one run and alternating, `--reps` syncs of each kind through the same services:

- all:   every pipeline stage leader streams the buckets of its own layers (SyncRequest senders=all)
- rank0: stage 1..n send their tensors to rank 0 over the trainer's own gloo group (not throttled:
         the trainer's internal network), and rank 0 alone streams everything (senders=rank0)

The rate is chosen so that the link, not the CPU, is the bottleneck (the unthrottled sync of the
same model is reported next to it). Speed-up = median rank0 sync seconds / median all seconds.

    OMP_NUM_THREADS=1 python -m bench multisender
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

from tests.support.bus_proxy import BusProxy, SenderLinks  # noqa: E402  (the test proxy: run from a checkout)
from weightsync.control.client import channel, trainer_stub  # noqa: E402
from weightsync.local.procs import free_port, start_rollout, start_trainer, wait_registered  # noqa: E402
from weightsync.v1 import trainer_pb2  # noqa: E402

# a Qwen2 shape whose two pipeline halves weigh about the same (untied embedding and head)
MODEL = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _sync(stub, senders: str) -> trainer_pb2.SyncReport:
    rep = stub.Sync(trainer_pb2.SyncRequest(senders=senders)).report
    if not rep.ok:
        raise RuntimeError(f"sync (senders={senders}) failed: {[r.error for r in rep.rollouts if not r.ok]}")
    return rep


def _row(rep: trainer_pb2.SyncReport) -> dict:
    return {
        "seconds": rep.seconds,
        "stream_s": rep.phase_seconds.get("stream", 0.0),
        "senders": [
            {
                "rank": s.rank,
                "mb": s.bytes / 1e6,
                "seconds": s.seconds,
                "forwarded_mb": s.forwarded_bytes / 1e6,
                "buffer_mb": s.peak_buffer_bytes / 1e6,
            }
            for s in rep.senders
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--rate-mb", type=float, default=20.0, help="per-sender link rate, MB/s")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    from transformers import Qwen2Config

    work = Path(tempfile.mkdtemp(prefix="bench-ms-"))
    Qwen2Config(**MODEL).save_pretrained(str(work / "model"))
    links = SenderLinks(None)
    trainer = start_trainer(
        work,
        "--backend",
        "megatron",
        "--model",
        str(work / "model"),
        "--pp",
        str(args.pp),
        "--bucket-mb",
        "4",
        "--no-auto-sync-new-rollouts",
        nproc=args.pp,
    )
    procs, proxies = [trainer], []
    try:
        for i in range(args.rollouts):
            dport = free_port()
            proxies.append(BusProxy(f"127.0.0.{2 + i}", dport, ("127.0.0.1", dport), links))
            procs.append(
                start_rollout(
                    work,
                    "--model",
                    str(work / "model"),
                    "--trainer-address",
                    trainer.address,
                    "--data-address",
                    f"127.0.0.1:{dport}",
                    "--advertise-data-host",
                    f"127.0.0.{2 + i}",
                    name=f"r{i}",
                )
            )
        for p in procs:
            p.wait_ready(300)
        wait_registered(trainer.address, [f"r{i}" for i in range(args.rollouts)])
        with channel(trainer.address) as ch:
            stub = trainer_stub(ch, "", 600)
            unthrottled = {k: _row(_sync(stub, k)) for k in ("all", "rank0")}  # also the warm-up
            links.reset(args.rate_mb * 1e6)
            runs: dict[str, list[dict]] = {"all": [], "rank0": []}
            for _ in range(args.reps):
                for kind in ("rank0", "all"):
                    runs[kind].append(_row(_sync(stub, kind)))
                    print(f"{kind:5s} {runs[kind][-1]['seconds']:.3f}s", flush=True)
            rep = _sync(stub, "all")
        med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
        result = {
            "machine": f"{platform.node()} {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})",
            "model_mb": rep.bytes / 1e6,
            "pp": args.pp,
            "rollouts": args.rollouts,
            "rate_mb_s_per_sender": args.rate_mb,
            "unthrottled": unthrottled,
            "runs": runs,
            "median_s": med,
            "link_bound_s": {
                "rank0": rep.bytes * args.rollouts / (args.rate_mb * 1e6),
                "all": max(s.bytes for s in rep.senders) * args.rollouts / (args.rate_mb * 1e6),
            },
            "speedup": med["rank0"] / med["all"],
        }
        print(json.dumps({k: result[k] for k in ("model_mb", "median_s", "link_bound_s", "speedup")}, indent=1))
        from bench.common.results import write_result

        rows = [
            {"senders": k, "sync_s": med[k], "rank0_s": med["rank0"], "link_bound_s": result["link_bound_s"][k]}
            for k in ("all", "rank0")
        ]
        baseline = {"what": "rank 0 alone streaming everything (senders=rank0), alternating", "rows_key": "rank0_s"}
        write_result("multisender", rows, baseline=baseline, out=args.out or None, device="cpu", **result)
        return 0
    finally:
        for p in proxies:
            p.close()
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
