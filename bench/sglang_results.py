"""bench/sglang_live.py's JSON in the house schema (bench/common/results.py): `bench`, `command`, `git`,
`device`, `torch`, `date`, `rows` (one per timing run, then one per token-check run) and `baseline` (the
built-in engine's sync in the same run), beside the bench's own `runs[]`, `timing_runs[]`, `colocated_rl`.

A timing row carries `model`; a token-check row does not (bench/cost_calibration.py skips it) and says
`check: "greedy"`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench.common.results import command_line, device_label, git_rev, validate

BASELINE = {
    "what": "the built-in engine's sync of the same weights over the same transport, same trainer, same run",
    "rows_key": "builtin_sync_s",
}
_TIMING_KEYS = ("model", "transport", "tp_size", "sync_s", "builtin_sync_s", "bytes_per_rank", "num_buckets", "route")
_GREEDY_KEYS = ("transport", "tp_size", "sync_s", "builtin_sync_s", "bytes_per_rank", "num_buckets", "route")
_GREEDY_KEYS += ("greedy_match", "greedy_match_up_to_ties", "max_abs_logprob_diff", "radix_cache_flushed")


def _ratio(r: dict) -> float | None:
    mine, base = r.get("sync_s"), r.get("builtin_sync_s")
    return mine / base if mine and base else None


def rows_of(res: dict) -> list[dict]:
    """The schema's rows: the runs that measured a sync (a run that failed before one is in `timing_runs` /
    `runs` with its error), every key named above present (None where the run did not record it)."""
    rows = []
    for r in (r for r in res.get("timing_runs", []) if r.get("sync_s") is not None):
        row = {k: r.get(k) for k in _TIMING_KEYS} | {"sync_bytes": r.get("bytes"), "over_builtin": _ratio(r)}
        rows.append(row | ({"error": r["error"]} if "error" in r else {}))
    for r in (r for r in res.get("runs", []) if r.get("sync_s") is not None):
        row = {"check": "greedy", **{k: r.get(k) for k in _GREEDY_KEYS}}
        row |= {"weights": res.get("weights"), "sync_bytes": r.get("bytes"), "over_builtin": _ratio(r)}
        rows.append(row | ({"error": r["error"]} if "error" in r else {}))
    return rows


def document(res: dict) -> dict:
    """`res` under the schema's keys; `res`'s own keys follow (it must not carry the schema's)."""
    doc = {
        "bench": "sglang_live",
        "command": command_line(),
        # a device host's copy of the tree has no .git: the caller may say which commit it is
        "git": os.environ.get("WS_GIT_REV") or git_rev(),
        "device": device_label(),
        "torch": res["torch"],
        "date": res["date"],
        "rows": rows_of(res),
        "baseline": None,
    }
    # no row (the colocated RL run alone, or nothing measured yet): nothing is compared with the baseline
    doc["baseline"] = BASELINE if doc["rows"] else None
    if os.environ.get("WS_LIVE_COMMAND"):  # bench/sglang_live.sh: the recipe's own line (env + LIVE_ARGS)
        doc["shell_command"] = os.environ["WS_LIVE_COMMAND"]
    clash = set(doc) & (set(res) - {"torch", "date"})
    if clash:
        raise ValueError(f"run keys {sorted(clash)} would overwrite the schema's: rename them")
    doc |= {k: v for k, v in res.items() if k not in doc}
    validate(doc)
    return doc


def save(res: dict, out: str | Path) -> None:
    Path(out).write_text(json.dumps(document(res), indent=2, default=str))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
