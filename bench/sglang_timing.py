"""The timed syncs of bench/sglang_live.py: per model shape (random weights) and transport, a fresh fleet
(one SGLang rollout, one built-in rollout), the SGLang rollout's sync time beside the built-in engine's in
the same run. One fleet per shape and transport, so two SGLang engines never share a GPU's memory."""

from __future__ import annotations

import json
import statistics
import traceback
from pathlib import Path

from bench.common.models import write_config
from bench.sglang_fleet import (
    TARGETS,
    Fleet,
    bytes_per_rank,
    direct_lines,
    log,
    rollout_layout,
    save_random_fp8,
    save_random_hf,
    sync_times,
)
from weightsync.v1 import rollout_pb2

#: syncs before the timed ones (_time_rollout)
TIMING_WARMUP = 2


def timing_runs(res: dict, models: list[str], work: Path, args, transports: list[str], gpus: int, save) -> None:
    """Every shape in `models` over every transport; `save()` after each (a run cut off keeps the rest)."""
    for model in models:
        for transport in transports:
            rollouts = {k: v for k, v in rollout_layout([transport], gpus, args.tp_size).items()}
            rollouts = {k: v for k, v in rollouts.items() if k in TARGETS[transport]}
            timing_one(res, model, work, args, transport, rollouts)
            save()


def _time_rollout(
    rec: dict, fleet: Fleet, rid: str, key: str, transport: str, reps: int, warmup: int = TIMING_WARMUP
) -> dict:
    """`warmup` + `reps` syncs into `rid`; the median of the last `reps` under `key`. Two warm-ups: an SGLang
    rollout's first sync learns its slot tables through SGLang's loader and exports them, its second maps them
    (the trainer's IPC mapping of SGLang's parameters, or SGLang's first use of the tables: ~100-170 ms on an
    H200 at 7B); from the third on a sync is steady. The built-in engine gets the same count."""
    log(f"timing {rec['model']}: syncing {rid} over {transport} ({warmup} + {reps})")
    reports, secs = sync_times(fleet.trainer.address, fleet.tstub, rid, transport, warmup + reps)
    rec[key + "_all"] = secs
    rec["warmup_syncs"] = warmup
    rec[key] = statistics.median(secs[warmup:])
    rec.setdefault("bytes", int(reports[0].get("bytes", 0)))
    rec.setdefault("num_buckets", reports[0].get("num_buckets"))
    rec[key.replace("sync_s", "phase_s_last")] = reports[-1].get("phase_seconds")
    # route / builtin_route: what the timed syncs took (SGLang: ipc/trainer_writes/... from its second on)
    rec[key.replace("sync_s", "route")] = reports[-1].get("route")
    rec[key.replace("sync_s", "routes_all")] = [r.get("route") for r in reports]
    log(f"timing {rec['model']}: {rid} sync_s={rec[key]:.4f}")
    return reports[-1]


def timing_one(res: dict, model: str, work: Path, args, transport: str, rollouts: dict) -> None:
    """`args.timing_dtype` fp8-block: the trainer sends block FP8, SGLang serves a block-FP8 checkpoint of the same
    weights (takes the pairs as they are), the built-in engine the 16-bit one (dequantizes)."""
    sid, bid = TARGETS[transport]
    dtype = getattr(args, "timing_dtype", "bfloat16")
    rec = {"model": model, "transport": transport, "tp_size": args.tp_size, "trainer_backend": "megatron"}
    rec |= {"weights": "random", "rollouts": rollouts, "export_dtype": dtype}
    res.setdefault("timing_runs", []).append(rec)
    fleet = None
    try:
        cfg_dir = write_config(model, work)
        start_dir = work / f"start-{model}"
        if not start_dir.exists():  # the second transport of a shape serves the same start weights
            save_random_hf(cfg_dir, start_dir, seed=2)
        fp8_dir = work / f"start-{model}-fp8"
        if dtype == "fp8-block" and not fp8_dir.exists():
            save_random_fp8(start_dir, fp8_dir)
        fleet = Fleet()
        fleet.start(
            work, cfg_dir, start_dir, rollouts, args.ready_timeout, tp_size=args.tp_size, export_dtype=dtype,
            sglang_dir=fp8_dir if dtype == "fp8-block" else None,
        )  # fmt: skip
        last = _time_rollout(rec, fleet, sid, "sync_s", transport, args.reps)
        rec["bytes_per_rank"] = bytes_per_rank(last)
        _time_rollout(rec, fleet, bid, "builtin_sync_s", transport, args.reps)
        # where SGLang's sync spends more than the built-in engine's, per trainer phase (the last sync of each)
        mine, theirs = rec.get("phase_s_last") or {}, rec.get("builtin_phase_s_last") or {}
        rec["phase_s_over_builtin"] = {k: mine[k] - theirs.get(k, 0.0) for k in sorted(mine)}
        st = fleet.stubs[sid].GetStatus(rollout_pb2.GetStatusRequest())
        rec["rollouts_on_version"] = st.version == int(last["version"])
        rec["direct_how"] = direct_lines(fleet, sid)
    except Exception as exc:  # noqa: BLE001 — recorded
        traceback.print_exc()
        rec["error"] = repr(exc)[:3000]
    finally:
        if fleet is not None:
            fleet.stop(res, tag=f"{model}-{transport}-")


def print_timing(res: dict) -> None:
    keys = ("model", "transport", "export_dtype", "tp_size", "sync_s", "builtin_sync_s", "bytes", "bytes_per_rank")
    keys += ("route", "builtin_route")
    for r in res.get("timing_runs", []):
        print(json.dumps({k: r.get(k) for k in (*keys, "num_buckets", "error", "direct_how")}), flush=True)
