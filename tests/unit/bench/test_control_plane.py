"""The control plane's cost grows with the buckets of a sync, not its tensors (bench/control_plane.py's path:
the trainer's plan, PrepareSync by layout digest, the hand-off, commit, report and status)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from bench.control_names import named_tensors
from bench.control_plane import Clock, Pair, main
from bench.model_arch import arch, footprint
from weightsync.bus.plan import TensorMeta

BUCKET = 2_560_000
_MLP = ("gate", "up", "down")


def _metas(count: int, total_bytes: int) -> list[TensorMeta]:
    width = total_bytes // count // 2  # bf16
    return [
        TensorMeta(f"model.layers.{i}.mlp.experts.0.up_proj.weight", (1, width), torch.bfloat16) for i in range(count)
    ]


@pytest.mark.serial
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_steady_state_control_time_follows_buckets_not_tensors(fmt):
    # equal bytes in equal buckets: 16 buckets of 2,560,000 bytes, as 160 tensors or as 1,600 (every size a
    # multiple of the 256-byte alignment, so both fill their buckets alike)
    # (block FP8: each weight and its scale, in 9 buckets)
    few, many = (Pair(_metas(n, 16 * BUCKET), fmt, BUCKET) for n in (160, 1600))
    clocks = {"few": Clock(), "many": Clock()}
    for name, pair in (("few", few), ("many", many)):
        clocks[name].start()
        tensors, buckets = pair.sync(clocks[name])  # first sync: the full manifest, validated
        want = {"bf16": (160, 16), "fp8-block": (320, 9)}[fmt]
        assert (tensors, buckets) == (want if name == "few" else (10 * want[0], want[1]))
    seconds: dict[str, list[float]] = {"few": [], "many": []}
    for _ in range(40):  # interleaved, so a busy machine slows both alike
        for name, pair in (("few", few), ("many", many)):
            clocks[name].start()
            t0 = time.perf_counter()
            pair.sync(clocks[name])
            seconds[name].append(time.perf_counter() - t0)
    ratio = statistics.median(seconds["many"]) / statistics.median(seconds["few"])
    assert ratio <= 1.5, f"10x the tensors at equal bytes cost {ratio:.2f}x the control time (median of 40 syncs)"


def _moe(layers: int, experts: int) -> list[TensorMeta]:
    out = []
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [TensorMeta(f"{p}.self_attn.{n}_proj.weight", (256, 256), torch.bfloat16) for n in "qkvo"]
        out.append(TensorMeta(f"{p}.mlp.gate.weight", (experts, 256), torch.bfloat16))
        for e in range(experts):
            out += [TensorMeta(f"{p}.mlp.experts.{e}.{n}_proj.weight", (128, 256), torch.bfloat16) for n in _MLP]
    return out


def _first_sync(metas, fmt: str, runs: bool) -> tuple[float, int, int]:
    """(CPU seconds of this process for a first sync, full-manifest entries, bytes on the wire)."""
    pair = Pair(metas, fmt, 1 << 30, runs=runs)
    t0 = time.process_time()  # CPU time: the other tenants of a loaded box do not count
    pair.sync(_started())
    took = time.process_time() - t0
    manifest = pair.orch._plan([], "tcp")[1]
    full = pair.orch.manifests.full_proto(manifest, runs=runs)
    return took, (sum(len(b.tensors) for b in full.buckets), full.ByteSize(), manifest.num_tensors)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_first_sync_with_runs_grows_slower_than_the_experts(fmt):
    # 8x the experts (7x the tensors): the full manifest with runs keeps one entry per layer's experts, and
    # the first sync's control time grows less than the tensors do (per-tensor Python is left: each
    # slot's object, its digest line, the engine's name check), and less than with plain manifests
    small, large = _moe(8, 16), _moe(8, 128)
    growth = len(large) / len(small)
    _first_sync(small, fmt, True), _first_sync(small, fmt, False)  # warm: imports, caches
    t = {(r, n): [] for r in (True, False) for n in ("small", "large")}
    wire = {}
    for _ in range(5):  # interleaved; the fastest of each: a shared 2-core box's stalls only ever add time
        for (runs, size), out in t.items():
            took, wire[(runs, size)] = _first_sync(small if size == "small" else large, fmt, runs)
            out.append(took)
    med = {k: min(v) for k, v in t.items()}
    (entries, nbytes, _), (entries_small, nbytes_small, _) = wire[(True, "large")], wire[(True, "small")]
    assert entries == entries_small and nbytes < 1.1 * nbytes_small  # one entry per layer's experts, any count
    plain_entries, _, tensors = wire[(False, "large")]
    assert plain_entries == tensors == wire[(True, "large")][2]
    runs_growth = med[(True, "large")] / med[(True, "small")]
    assert runs_growth < growth, f"{growth:.1f}x the tensors cost {runs_growth:.2f}x the first-sync control time"
    assert med[(True, "large")] < med[(False, "large")], med


def test_a_rollout_that_lost_the_layout_is_sent_the_full_manifest():
    pair = Pair(_metas(64, 1 << 20), "fp8-block", 1 << 18)
    pair.sync(_started())
    (digest,) = pair.servicer.layouts._by_digest
    assert pair.orch.manifests.holds(pair.entry, digest)
    pair.servicer = pair.rollout_from()  # restarted: no layout held
    assert len(pair.servicer.layouts) == 0
    pair.sync(_started())  # the digest is answered manifest_needed, then the full manifest commits
    assert len(pair.servicer.layouts) == 1
    assert pair.servicer.tx.version == pair.actor.version


def _started() -> Clock:
    c = Clock()
    c.start()
    return c


def test_the_names_agree_with_the_model_arch_counts():
    for model in ("qwen3-235b-a22b", "deepseek-v3", "kimi-k2"):
        names = named_tensors(arch(model))
        assert len(names) == footprint(arch(model), "bf16").tensors
        assert len({n for n, _ in names}) == len(names)


def test_the_bench_writes_its_rows(tmp_path):
    out = tmp_path / "cp.json"
    assert main(["--models", "qwen2.5-1.5b", "--dtypes", "bf16,fp8-block", "--syncs", "2", "--out", str(out)]) == 0
    import json

    got = json.loads(out.read_text())
    assert got["bench"] == "control_plane" and got["baseline"]["rows_key"] == "plain_first_s"
    bf16, fp8 = got["rows"]
    assert (bf16["model"], bf16["dtype"], fp8["dtype"]) == ("qwen2.5-1.5b", "bf16", "fp8-block")
    assert (bf16["tensors"], fp8["tensors"]) == (
        footprint(arch("qwen2.5-1.5b"), "bf16").tensors,
        footprint(arch("qwen2.5-1.5b"), "fp8").tensors,
    )
    for row in (bf16, fp8):
        assert row["buckets"] > 0 and row["steady_s"] > 0 and row["first_s"] > 0
        assert set(row["phases"]) == {"plan", "prepare", "write", "commit", "report", "status"}
