"""bench/sglang_live.py's file in the house schema (bench/sglang_results.py): timing rows with their model,
token-check rows without one (bench/cost_calibration.py skips those), the built-in engine as the baseline,
and the bench's own runs[] / timing_runs[] kept."""

from __future__ import annotations

import pytest

from bench import sglang_results
from bench.common import results


def _res() -> dict:
    timing = {"model": "7b", "transport": "nccl", "tp_size": 1, "sync_s": 0.0505, "builtin_sync_s": 0.0488}
    timing |= {"bytes": 15_231_233_024, "bytes_per_rank": [15_231_233_024], "num_buckets": 15, "route": "nccl"}
    failed = {"model": "1.5b", "transport": "ipc", "tp_size": 1, "error": "RuntimeError('no GPU')"}
    greedy = {"transport": "ipc", "tp_size": 1, "sync_s": 0.004, "builtin_sync_s": 0.002, "num_buckets": 5}
    greedy |= {"bytes": 5_000_000, "greedy_match": True, "max_abs_logprob_diff": 1.4e-6}
    return {"torch": "2.13", "date": "2026-11-28T21:13:00Z", "weights": "trained", "runs": [greedy]} | {
        "timing_runs": [timing, failed],
        "colocated_rl": {"first_reward": 0.1},
    }


def test_the_file_has_the_schema_keys_and_keeps_the_bench_own(monkeypatch):
    monkeypatch.setenv("WS_GIT_REV", "abc1234")
    monkeypatch.setattr(results, "_command", "python bench/sglang_live.py --out x")
    doc = sglang_results.document(_res())
    results.validate(doc)
    assert (doc["bench"], doc["git"], doc["command"]) == (
        "sglang_live",
        "abc1234",
        "python bench/sglang_live.py --out x",
    )
    assert doc["baseline"]["rows_key"] == "builtin_sync_s"
    timing, greedy = doc["rows"]  # the failed timing run measured nothing: it stays in timing_runs only
    assert timing["model"] == "7b" and timing["sync_s"] == 0.0505 and timing["builtin_sync_s"] == 0.0488
    assert timing["over_builtin"] == pytest.approx(0.0505 / 0.0488) and timing["sync_bytes"] == 15_231_233_024
    assert timing["bytes_per_rank"] == [15_231_233_024] and timing["num_buckets"] == 15
    assert "model" not in greedy and greedy["check"] == "greedy" and greedy["num_buckets"] == 5
    assert greedy["greedy_match"] is True and greedy["over_builtin"] == pytest.approx(2.0)
    assert len(doc["timing_runs"]) == 2 and doc["runs"][0]["sync_s"] == 0.004 and doc["colocated_rl"]


def test_a_run_key_that_would_overwrite_the_schema_is_refused():
    with pytest.raises(ValueError, match=r"run keys \['rows'\] would overwrite"):
        sglang_results.document(_res() | {"rows": []})
