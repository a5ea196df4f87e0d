"""A picture of the dashboard's main panels from a real short CPU run (docs/dashboard_cpu_run.png).

No Prometheus here, so this scrapes the services' /metrics itself after every step of a short RL-like
loop and computes what the panels' queries compute from those samples: a trainer (hf, tiny-qwen2)
and two rollouts (built-in engine) in this process on loopback; each step trains once (TrainStep),
syncs (every third step leaves rollout r2 out, so it falls behind and is caught up by the next full
sync) and sends generation requests to both rollouts from a few threads. Rates are over the last
`--window` steps; quantiles interpolate within the histogram's buckets as histogram_quantile does.
The services share this process, so there is one resident-memory line.

    OMP_NUM_THREADS=1 python scripts/plot_dashboard.py --steps 24 --out docs/dashboard_cpu_run.png
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKEN = "plot-token"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        fams = text_string_to_metric_families(r.read().decode())
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def pick(sample: dict, name: str, **labels: str) -> dict[tuple, float]:
    return {k: v for k, v in sample.items() if k[0] == name and set(labels.items()) <= set(k[1])}


def total(sample: dict, name: str, **labels: str) -> float:
    return sum(pick(sample, name, **labels).values())


def quantile(q: float, old: dict, new: dict, name: str, **labels: str) -> float:
    """histogram_quantile(q, sum by (le) (increase(name_bucket{labels}))) between two scrapes."""
    buckets: dict[float, float] = {}
    for (_, lab), v in pick(new, name + "_bucket", **labels).items():
        le = float(dict(lab)["le"])
        buckets[le] = buckets.get(le, 0.0) + v - old.get((name + "_bucket", lab), 0.0)
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return math.nan
    rank, lower, below = q * buckets[edges[-1]], 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


def run(steps: int) -> tuple[list[float], list[dict[str, dict]]]:
    from tests.support.local_apps import local_fleet
    from tests.support.train_requests import make_request
    from weightsync.control.client import channel, rollout_stub
    from weightsync.v1 import rollout_pb2, trainer_pb2

    times, scrapes = [], []
    with local_fleet({"r1": {}, "r2": {}}, TOKEN) as (trainer, rollouts, stub):
        ports = {"trainer": trainer.http.port, **{rid: app.http.port for rid, app in rollouts.items()}}
        stubs = {rid: rollout_stub(channel(app.grpc.address), TOKEN, 60) for rid, app in rollouts.items()}

        def generate(rid: str, seed: int) -> None:
            stubs[rid].Generate(
                rollout_pb2.GenerateRequest(
                    prompts=[rollout_pb2.Prompt(token_ids=[1 + seed % 50, 2, 3, 4])],
                    sampling=rollout_pb2.SamplingParams(max_new_tokens=8 + seed % 9, temperature=1.0, seed=seed, n=2),
                )
            )

        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            for step in range(steps):
                stub.TrainStep(make_request(seed=step))
                only = ["r1"] if step % 3 == 1 else []
                assert stub.Sync(trainer_pb2.SyncRequest(rollout_ids=only)).report.ok
                list(
                    pool.map(generate, ["r1", "r2"] * (3 + step % 4), range(step * 10, step * 10 + 2 * (3 + step % 4)))
                )
                times.append(time.monotonic() - t0)
                scrapes.append({name: scrape(port) for name, port in ports.items()})
    return times, scrapes


def plot(times: list[float], scrapes: list[dict], window: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(13, 10), constrained_layout=True)
    rids = [k for k in scrapes[0] if k != "trainer"]
    idx = range(window, len(scrapes))
    xs = [times[i] for i in idx]

    ax = axes[0][0]
    ax.set_title("Weights version per pod")
    for pod in scrapes[0]:
        wide = {"linewidth": 5, "alpha": 0.35} if pod == "trainer" else {}  # under the rollouts that match it
        ax.step(times, [total(s[pod], "weightsync_weights_version") for s in scrapes], where="post", label=pod, **wide)
    ax.legend()

    ax = axes[0][1]
    ax.set_title("Sync duration p50 / p95 (trainer) and phase p95")
    h = "weightsync_sync_duration_seconds"
    for q in (0.5, 0.95):
        ys = [quantile(q, scrapes[i - window]["trainer"], scrapes[i]["trainer"], h, role="trainer") for i in idx]
        ax.plot(xs, ys, label=f"p{int(q * 100)}")
    for phase in ("plan", "prepare", "stream", "commit"):
        ys = [
            quantile(
                0.95,
                scrapes[i - window]["trainer"],
                scrapes[i]["trainer"],
                "weightsync_sync_phase_seconds",
                phase=phase,
            )
            for i in idx
        ]
        ax.plot(xs, ys, "--", label=f"{phase} p95")
    ax.set_ylabel("s")
    ax.legend(fontsize=8)

    def rate(pod: str, name: str, i: int, **labels) -> float:
        dt = times[i] - times[i - window]
        return (total(scrapes[i][pod], name, **labels) - total(scrapes[i - window][pod], name, **labels)) / dt

    ax = axes[1][0]
    ax.set_title("Sync throughput per rollout (weight bytes per second of its syncs)")
    for rid in rids:
        ys = [
            rate(rid, "weightsync_sync_bytes_total", i)
            / max(rate(rid, "weightsync_sync_duration_seconds_sum", i), 1e-12)
            for i in idx
        ]
        ax.plot(xs, [y / 1e6 for y in ys], label=rid)
    ax.set_ylabel("MB/s")
    ax.legend()

    ax = axes[1][1]
    ax.set_title("Syncs by outcome (increase per step)")
    for pod, outcome in [("trainer", "ok"), *[(rid, "committed") for rid in rids]]:
        ys = [
            total(scrapes[i][pod], "weightsync_syncs_total", outcome=outcome)
            - total(scrapes[i - 1][pod], "weightsync_syncs_total", outcome=outcome)
            for i in range(1, len(scrapes))
        ]
        ax.step(times[1:], ys, where="post", label=f"{pod} {outcome}")
    ax.legend()

    ax = axes[2][0]
    ax.set_title("Generation: tokens per second and latency p95 per rollout")
    ax2 = ax.twinx()
    for rid in rids:
        ax.plot(xs, [rate(rid, "weightsync_completion_tokens_total", i) for i in idx], label=f"{rid} tokens/s")
        ys = [
            quantile(0.95, scrapes[i - window][rid], scrapes[i][rid], "weightsync_generation_duration_seconds")
            for i in idx
        ]
        ax2.plot(xs, ys, "--", label=f"{rid} p95 latency (s)")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)

    ax = axes[2][1]
    ax.set_title("Resident memory (one process hosts all three here)")
    ax.plot(times, [total(s["trainer"], "process_resident_memory_bytes") / 2**20 for s in scrapes])
    ax.set_ylabel("MiB")
    for a in axes.flat:
        a.set_xlabel("s since start")
    fig.suptitle("weightsync dashboard panels over a short CPU run (tiny-qwen2, 1 trainer, 2 rollouts, TCP)")
    fig.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--window", type=int, default=3, help="steps a rate or quantile looks back over")
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboard_cpu_run.png"))
    args = ap.parse_args(argv)
    times, scrapes = run(args.steps)
    plot(times, scrapes, args.window, Path(args.out))
    print(f"wrote {args.out} ({args.steps} steps in {times[-1]:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
