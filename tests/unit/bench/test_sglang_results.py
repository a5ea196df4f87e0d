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


def test_a_run_without_a_measured_sync_has_no_rows_and_no_baseline():
    res = _res() | {"runs": [], "timing_runs": [{"model": "7b", "transport": "ipc", "error": "cut off"}]}
    doc = sglang_results.document(res)
    assert doc["rows"] == [] and doc["baseline"] is None and doc["colocated_rl"] == {"first_reward": 0.1}


def test_timing_runs_time_every_shape_over_every_transport_each_in_a_fleet_of_its_own(monkeypatch, tmp_path):
    """`--timing-model 1.5b,7b --timing-transports ipc,nccl`: one timing_runs[] entry (and row) per shape and
    transport, SGLang's sync and the built-in engine's from the same fleet, which is stopped after each."""
    from types import SimpleNamespace

    from bench import sglang_timing

    fleets, saved = [], []

    class Fleet:
        def __init__(self):
            self.trainer, self.tstub, self.stopped = SimpleNamespace(address="t"), None, False
            self.stubs = {k: SimpleNamespace(GetStatus=lambda req: SimpleNamespace(version=7)) for k in TARGET_IDS}
            fleets.append(self)

        def start(self, work, cfg_dir, start_dir, rollouts, ready_timeout, tp_size=1, export_dtype="?", sglang_dir="?"):
            assert (export_dtype, sglang_dir) == ("bfloat16", None)  # no --timing-dtype: bf16, SGLang serves start_dir
            self.rollouts = rollouts

        def stop(self, res, tag=""):
            self.stopped = tag

    TARGET_IDS = ("s0", "b0", "s1", "b1")

    def sync_times(address, tstub, rid, transport, reps):
        assert reps == 2 + 3  # two warm-ups (learning the tables, mapping them), then --reps timed
        secs = {"s": 0.02, "b": 0.01}[rid[0]]
        rep = {"version": "7", "bytes": "300", "num_buckets": 3, "route": f"{transport}/x"}
        rep["rollouts"] = [{"bytes_per_rank": ["300"]}]  # uint64 fields come as strings from MessageToDict
        return [rep] * reps, [1.0, 0.5] + [secs] * (reps - 2)  # the warm-ups are not in the median

    monkeypatch.setattr(sglang_timing, "Fleet", Fleet)
    monkeypatch.setattr(sglang_timing, "sync_times", sync_times)
    monkeypatch.setattr(sglang_timing, "write_config", lambda model, work: tmp_path / model)
    monkeypatch.setattr(sglang_timing, "save_random_hf", lambda cfg, out, seed: saved.append(out) or out.mkdir())
    monkeypatch.setattr(sglang_timing, "direct_lines", lambda fleet, name: [])
    res, saves = {}, []
    args = SimpleNamespace(tp_size=1, reps=3, ready_timeout=1.0)
    sglang_timing.timing_runs(res, ["1.5b", "7b"], tmp_path, args, ["ipc", "nccl"], 2, lambda: saves.append(1))
    got = [
        (r["model"], r["transport"], r["sync_s"], r["builtin_sync_s"], r["bytes_per_rank"]) for r in res["timing_runs"]
    ]
    assert got == [
        ("1.5b", "ipc", 0.02, 0.01, [300]),
        ("1.5b", "nccl", 0.02, 0.01, [300]),
        ("7b", "ipc", 0.02, 0.01, [300]),
        ("7b", "nccl", 0.02, 0.01, [300]),
    ]
    assert [set(f.rollouts) for f in fleets] == [{"s0", "b0"}, {"s1", "b1"}] * 2 and all(f.stopped for f in fleets)
    assert len(saved) == 2 and len(saves) == 4  # one start checkpoint per shape; the file written after each
    rows = sglang_results.rows_of(res)
    assert [(r["model"], r["transport"], r["num_buckets"]) for r in rows][1] == ("1.5b", "nccl", 3)
