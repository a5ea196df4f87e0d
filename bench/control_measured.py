"""The control plane's measured cost at scale, for the fleet cost model: the rows of the newest
bench/results/control_plane_cpu_*.json (bench/control_plane.py) and a per-bucket fit of them.

A sync's control host work at full scale was measured on a CPU (no GPU: plan, PrepareSync by layout
digest, the hand-off, commit, report and status, one rollout). Its steady state grows with the buckets,
not the tensors, so a model without a measured row is predicted from the measured rows' cost per
bucket (least squares through the origin). Pure Python, no torch.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: model_arch's dtype names -> the bench's
_DTYPE = {"bf16": "bf16", "fp8": "fp8-block"}


@dataclass(frozen=True)
class ControlRow:
    model: str
    dtype: str  # the bench's: bf16 or fp8-block
    tensors: int
    buckets: int
    first_s: float
    steady_s: float
    rejoin_s: float
    source: str
    #: the same run's first and restarted syncs with plain manifests (every tensor an entry); None before runs
    plain_first_s: float | None = None
    plain_rejoin_s: float | None = None


def _run_order(path: Path) -> tuple[str, int]:
    """(date, run of the day): `..._2026-11-28-2.json` is the day's second run, after `..._2026-11-28.json`
    (a plain sort puts "-" before ".")."""
    stem = path.stem.removeprefix("control_plane_cpu_")
    date, _, n = stem[:10], stem[10:11], stem[11:]
    return date, int(n) if n.isdigit() else 1


@functools.lru_cache(maxsize=1)
def _newest() -> tuple[str, dict] | None:
    files = sorted(RESULTS.glob("control_plane_cpu_*.json"), key=_run_order)
    return (files[-1].name, json.loads(files[-1].read_text())) if files else None


def before_row(model: str, dtype: str) -> dict | None:
    """The row of `model` in `dtype` (the bench's names) recorded in the newest result's `before` (the
    same bench on the tree before that result's change), or None."""
    got = _newest()
    earlier = (got[1].get("before") or {}).get("rows", []) if got else []
    return next((r for r in earlier if r["model"] == model and r["dtype"] == dtype), None)


def before_steady_s(model: str, dtype: str) -> float | None:
    """before_row's steady state, or None."""
    r = before_row(model, dtype)
    return None if r is None else r["steady_s"]


@functools.lru_cache(maxsize=1)
def rows() -> tuple[ControlRow, ...]:
    """Every row of the newest control_plane_cpu result (by the date in its name); () when none."""
    got = _newest()
    if got is None:
        return ()
    name, data = got
    return tuple(
        ControlRow(
            r["model"],
            r["dtype"],
            r["tensors"],
            r["buckets"],
            r["first_s"],
            r["steady_s"],
            r.get("rejoin_s", r["first_s"]),
            f"{name} {r['model']} {r['dtype']}",
            r.get("plain_first_s"),
            r.get("plain_rejoin_s"),
        )
        for r in data["rows"]
    )


def row(model: str, dtype: str) -> ControlRow | None:
    """The measured row of `model` in `dtype` (model_arch's name: bf16 or fp8), or None."""
    want = _DTYPE.get(dtype, dtype)
    return next((r for r in rows() if r.model == model and r.dtype == want), None)


@functools.lru_cache(maxsize=1)
def per_bucket_s() -> float:
    """Steady-state control seconds per bucket, fitted through the origin over the measured rows."""
    got = rows()
    if not got:
        raise FileNotFoundError(f"no control_plane_cpu_*.json in {RESULTS}: run bench/control_plane.py")
    return sum(r.steady_s * r.buckets for r in got) / sum(r.buckets * r.buckets for r in got)


def buckets(total_bytes: float, bucket_bytes: int) -> int:
    """Buckets of a sync of `total_bytes` (a lower bound: a tensor larger than what is left of a bucket
    starts the next)."""
    return max(1, math.ceil(total_bytes / bucket_bytes))
