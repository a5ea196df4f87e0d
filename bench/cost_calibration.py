"""The cost model against every recorded 1 -> 1 GPU measurement (bench/results/history/results_*.json).

Each point names the JSON file and field it reads, so the measurement is the recorded one, not a
number copied by hand. Provenance of the constants in `cost_model.Calibration`:

- nvlink_gbs 367, msg_latency_s 25 us: NCCL broadcast on NV18 is t = 25 us + bytes / 367 GB/s
  within 2% from 16 MiB to 4 GiB (`MESSAGE_CURVE`, a message-size sweep on the same 2x H200 host;
  not kept as a JSON file); the raw columns of the bus runs (7B 41.4 ms, 32B 177.7 ms in 1 GiB
  messages) agree to 1%.
- hbm_rw_gbs 3800: the IPC benchmark's copy bound (15.23 GB copied in 8.0 ms, read + write).
- checksum_gbs 2773: the fused Triton checksum kernel.
- plan_prepare_s, commit_s: the services run's phase medians for 7B (3.3 + 7.8, 2.1 ms).
- per_tensor_s: FITTED (`fit_per_tensor`) to the stream phase of the two services NCCL points.
- ipc_bucket_s: FITTED to the bus-only IPC point; ipc_rpc_bucket_s: FITTED to the services IPC
  point. Both are fitted on one point each, so those two points check nothing (flagged below).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common.results import RESULTS
from bench.cost_model import CAL, MULTI, Calibration, Fleet, Sync, Trainer, predict
from bench.model_arch import arch, footprint

HISTORY = RESULTS / "history"  # the runs before the one schema (each in its own shape)

MIB = 1 << 20
GIB = 1024 * MIB


# NCCL broadcast 1 -> 1 on NV18 (2x H200): message bytes -> GB/s (1 MiB is launch-bound; left out)
MESSAGE_CURVE = {16 * MIB: 241.0, 64 * MIB: 321.0, 256 * MIB: 350.0, 1024 * MIB: 364.0, 4096 * MIB: 367.0}


@dataclass(frozen=True)
class Point:
    label: str
    model: str  # key of model_arch.ARCHS
    measured_s: float
    sync: Sync
    weights: str = "bf16"  # the hf backend holds fp32 and casts during the sync
    source: str = ""
    fitted: str = ""  # which constant was fitted on this point ("" = an independent check)
    #: the engine the bytes went to: one GPU on the trainer's NVLink (or the same GPU for IPC) unless said
    fleet: Fleet = Fleet(same_node=True)
    #: bytes each engine rank received, as the run recorded them (a sharded receiver's point; None: not recorded)
    per_rank_bytes: float | None = None

    def predicted_s(self, cal: Calibration = CAL) -> float:
        fp = footprint(arch(self.model))
        # one trainer GPU
        tr = Trainer(nodes=1, gpus_per_node=1, weights=self.weights)
        return predict(fp, tr, self.fleet, sync=self.sync, mode=MULTI, cal=cal).seconds

    def predicted_rank_bytes(self) -> float:
        """Bytes the model has each engine rank receive (cost_model's receiver modes)."""
        total = footprint(arch(self.model)).bytes
        return total if self.fleet.receiver == "full" else total / self.fleet.tp

    def error(self, cal: Calibration = CAL) -> float:
        return self.predicted_s(cal) / self.measured_s - 1.0


def _load(name: str) -> dict:
    return json.loads((HISTORY / name).read_text())


def _median(xs) -> float:
    return statistics.median(xs)


def bus_points() -> list[Point]:
    """bench_sync.py, receiver's clock (`*_s_rx`), 1 trainer GPU -> 1 engine GPU over NVLink."""
    out = []
    src = "results_2xh200_2026-11-23.json"
    for r in _load(src)["nccl_1to1"]:
        for mb in (256, 1024):
            out.append(
                Point(
                    f"bus {r['model'].upper()} {mb} MiB",
                    f"qwen2.5-{r['model']}",
                    _median(r[f"bus_{mb}MiB_s_rx"]),
                    Sync(mb * MIB, checksum=False, services=False),
                    source=f"{src} bus_{mb}MiB_s_rx",
                )
            )
    src = "results_2xh200_csum_2026-11-23.json"
    for r in _load(src)["nccl_1to1"]:
        out.append(
            Point(
                f"bus {r['model'].upper()} 1024 MiB + checksum",
                f"qwen2.5-{r['model']}",
                _median(r["bus_1024MiB_csum_s_rx"]),
                Sync(GIB, checksum=True, services=False),
                source=f"{src} bus_1024MiB_csum_s_rx",
            )
        )
    return out


def services_points() -> list[Point]:
    """bench_services.py: trainer-svc (hf backend, fp32 -> bf16 on export) -> rollout-svc, NCCL."""
    out = []
    for src, tag in (
        ("results_services_nccl_phases_2xh200_2026-11-23.json", "run 2"),
        ("results_services_nccl_2xh200_2026-11-23.json", "run 1"),
    ):
        for m in _load(src)["models"]:
            out.append(
                Point(
                    f"services {m['model'].upper()} NCCL ({tag})",
                    f"qwen2.5-{m['model']}",
                    m["sync_s"],
                    Sync(GIB),
                    weights="fp32",
                    source=f"{src} sync_s",
                )
            )
    return out


def ipc_points() -> list[Point]:
    src = "results_2xh200_2026-11-23.json"
    r = _load(src)["ipc"][0]
    pts = [
        Point(
            "bus 7B CUDA IPC 1 GiB",
            "qwen2.5-7b",
            _median(r["ipc_s"]),
            Sync(GIB, checksum=False, services=False, transport="ipc"),
            source=f"{src} ipc[0].ipc_s",
            fitted="ipc_bucket_s",
        )
    ]
    src = "results_services_ipc_h200_2026-11-23.json"
    m = _load(src)["models"][0]
    pts.append(
        Point(
            "services 7B CUDA IPC",
            "qwen2.5-7b",
            m["sync_s"],
            Sync(GIB, transport="ipc"),
            weights="fp32",
            source=f"{src} sync_s",
            fitted="ipc_rpc_bucket_s",
        )
    )
    return pts


def stream_phase_points() -> list[tuple[Point, float]]:
    """Services NCCL points with their measured stream phase (the run that recorded phases)."""
    src = "results_services_nccl_phases_2xh200_2026-11-23.json"
    return [
        (
            Point(
                m["model"], f"qwen2.5-{m['model']}", m["phase_s"]["stream"], Sync(GIB, services=False), weights="fp32"
            ),
            m["phase_s"]["stream"],
        )
        for m in _load(src)["models"]
    ]


def all_points() -> list[Point]:
    return bus_points() + services_points() + ipc_points()


#: SGLang runs (bench/sglang_live.py) whose engine has this many ranks: the first sharded receivers to check
SHARD_TP = 2


def shard_points(results: Path = RESULTS) -> list[Point]:
    """The model against SGLang runs with tp_size=2 over NCCL (the 2-GPU run of bench/sglang_live.py with
    a receiver that gives each rank its own bytes): one point per row of every `sglang_live_*.json` whose
    `tp_size` is SHARD_TP, with its `sync_s` and `bytes_per_rank`. A row whose ranks each took every byte
    is a `full` receiver (each rank loads the whole model), fewer a `shard` one. [] until such a run is
    recorded. Kept apart from `all_points`: the SGLang loader is not the built-in engine the constants were
    fitted on, so these points test the receiver model (bytes per rank, ingress over TP ranks), and their
    error is read, not bounded (docs/BENCHMARKS.md "Sharded receivers")."""
    out = []
    for path in sorted(results.glob("sglang_live_*.json")):
        data = json.loads(path.read_text())
        for i, r in enumerate(data.get("rows", [])):
            if r.get("tp_size") != SHARD_TP or r.get("transport") != "nccl" or "model" not in r:
                continue  # IPC is one GPU (colocated); a tp_size=1 row is a 1 -> 1 pair; no model: a token check
            name = f"qwen2.5-{r['model']}"
            total = footprint(arch(name)).bytes
            per_rank = r.get("bytes_per_rank")
            if per_rank is None:
                raise ValueError(f"{path.name} rows[{i}]: a tp_size={SHARD_TP} row must record bytes_per_rank")
            if isinstance(per_rank, list):  # RolloutSyncResult.bytes_per_rank: one figure per rank
                per_rank = max(per_rank)
            receiver = "full" if per_rank >= total else "shard"
            out.append(
                Point(
                    f"SGLang {r['model'].upper()} NCCL, tp_size={SHARD_TP} ({receiver} receiver)",
                    name,
                    r["sync_s"],
                    Sync(GIB),
                    weights=r.get("trainer_weights", "bf16"),
                    source=f"{path.name} rows[{i}].sync_s",
                    fleet=Fleet(replicas=1, tp=SHARD_TP, receiver=receiver, same_node=True),
                    per_rank_bytes=float(per_rank),
                )
            )
    return out


def fit_per_tensor(lo: float = 0.0, hi: float = 200e-6, steps: int = 2001) -> float:
    """Per-tensor host cost minimising the squared relative error of the stream phases."""
    pts = stream_phase_points()

    def loss(c: float) -> float:
        cal = replace(CAL, per_tensor_s=c)
        return sum((p.predicted_s(cal) / s - 1.0) ** 2 for p, s in pts)

    grid = [lo + (hi - lo) * i / (steps - 1) for i in range(steps)]
    return min(grid, key=loss)


def fit_ipc(cal: Calibration = CAL) -> tuple[float, float]:
    """(ipc_bucket_s, ipc_rpc_bucket_s) that make the two IPC points exact."""
    bus, svc = ipc_points()
    nb = 15  # ceil(15.23 GB / 1 GiB)
    base = replace(cal, ipc_bucket_s=0.0, ipc_rpc_bucket_s=0.0)
    bucket = (bus.measured_s - bus.predicted_s(base)) / nb
    rpc = (svc.measured_s - svc.predicted_s(replace(base, ipc_bucket_s=bucket))) / nb
    return bucket, rpc
