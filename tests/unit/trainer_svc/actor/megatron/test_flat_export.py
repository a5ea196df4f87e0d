"""The Megatron export straight into the buckets (flat_export.py) at TP=1: byte-identical to the HF
checkpoint it loaded and to the per-tensor export packed by the pipeline, for a GQA model with a
padded vocabulary (qwen2, llama, qwen3 with per-head norms) and a tied one, in bf16 (fp32 norms
cast into their slots) and fp32, with the model in one bucket and in many (gate and up split across
buckets, the embedding alone); the buckets follow a training step and a parameter given new storage.
Pipeline stages (PP=2, and VPP=2) at TP=EP=1, and expert-parallel ranks (EP=2, and PP=2 x EP=2) of
MoE models at TP = expert-TP = 1: each sender rank's flat buckets over the buckets it owns, the same
way against its own packed export, in both expert layouts (sequential; grouped in bf16). Other
multi-rank layouts take the per-tensor export, whose TP>1 assembly test_megatron_dist.py checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.support.megatron_models import FAMILIES, MOE_FAMILIES, SUPPORT, make_config, save_random_hf, torchrun


def _report(hf_dirs, tmp_path, env=None) -> dict:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "_flat_export_cases.py"), str(out), *[f"{f}={hf_dirs[f]}" for f in FAMILIES]],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_flat_buckets_are_the_export_byte_for_byte(hf_dirs, tmp_path):
    report = _report(hf_dirs, tmp_path)
    _check(report)
    for rep in report.values():
        # off the GPU every converted copy is torch's
        assert all(r["launches"] == 0 and r["torch_copies"] == r["copies"] for r in rep.values() if isinstance(r, dict))


def test_flat_buckets_through_the_copy_kernel_are_the_export_byte_for_byte(hf_dirs, tmp_path):
    """The same cases with the converted copies run by the Triton copy kernel (its interpreter on a
    machine without a GPU), as a GPU sync runs them: every pair taken by the table, 1-2 launches."""
    pytest.importorskip("triton")
    report = _report(hf_dirs, tmp_path, env={**os.environ, "FLAT_CASES_KERNEL": "1", "TRITON_INTERPRET": "1"})
    _check(report, kernel=True)
    for family, rep in report.items():
        for case, r in rep.items():
            if isinstance(r, dict):
                assert r["torch_copies"] == 0 and 1 <= r["launches"] <= 4, f"{family} {case}: {r}"


def _check(report: dict, kernel: bool = False) -> None:
    assert sorted(report) == sorted(FAMILIES)
    for family, rep in report.items():
        assert "error" not in rep, f"{family}: {rep['error']}"
        _check_fp8(family, rep.pop("fp8"), kernel)
        for case, r in rep.items():
            if not isinstance(r, dict):
                continue
            where = f"{family} {case}"
            assert r["iter_vs_hf"] == [], f"{where}: per-tensor export differs from the checkpoint in buckets {r}"
            assert r["flat_vs_hf"] == [], f"{where}: flat buckets differ from the checkpoint in buckets {r}"
            assert r["aliased_bytes"] > 0 and r["copies"] > 0, f"{where}: {r}"
            assert r["aliased_bytes"] + r["copied_bytes"] == r["total_bytes"], f"{where}: {r}"
            assert r["logits_unchanged"], f"{where}: moving parameters into the buckets changed the model"
            assert r["reused"], f"{where}: a second sync of the same layout planned again"
            assert r["after_step_changed"] and r["after_step_vs_iter"] == [], (
                f"{where}: after a step the buckets do not hold the new weights {r}"
            )
            assert r["replanned"] and r["stale_vs_iter"] == [], f"{where}: a parameter with new storage {r}"
        big = rep["bfloat16-4194304"]
        if family != "qwen3":  # qwen3's q/k norms are fp32 too: still a small part
            # one bucket, bf16: every bf16 parameter but QKV (query-group interleaved) and the padded
            # vocabulary is sent from its own storage
            assert big["copies"] < 40, big
        assert rep["cast_flat_is_none"], f"{family}: fp32 parameters exported as bf16 must take the pack path"
        assert rep["cast_iter_vs_hf"] == [], f"{family}: the casting per-tensor export differs"


def _check_fp8(family: str, cases: dict, kernel: bool) -> None:
    """Block-FP8 layouts: the flat buckets (FP8 weights quantized into their slots, one launch per
    bucket with the kernel) are the per-tensor export packed, byte for byte, before and after a step;
    a nan weight is caught by the flag and named as the per-tensor export names it. Written into an
    engine by the trainer (ipc trainer_writes, the FP8 slots never quantized), the engine holds what
    the rollout's dequantize of those buckets gives and the checksums are the buckets'; a nan weight
    fails the write naming it."""
    assert len(cases) == 2, cases
    apart = 0
    for bucket, r in cases.items():
        where = f"{family} fp8 bucket {bucket}"
        assert r["flat_vs_iter"] == [], f"{where}: flat FP8 buckets differ from the packed export {r}"
        assert r["after_step_vs_iter"] == [], f"{where}: after a step {r}"
        assert r["finite"] and not r["nan_finite"], f"{where}: {r}"
        assert r["nan_error"] == r["iter_error"] != "" and r["bad"] in r["nan_error"], f"{where}: {r}"
        assert r["quantized_bytes"] == r["fp8_bytes"] > 0, f"{where}: {r}"
        assert r["known_sums"] and r["known_vs_read"], f"{where}: the quantizer's sums + the rest != checksums {r}"
        # ipc trainer_writes from the actor's buckets, FP8 slots unwritten: the rollout_reads values and sums
        tw = r["trainer_writes"]
        assert tw["error"] == "" and tw["fused"] and tw["engine_dtypes"], f"{where}: {tw}"
        assert tw["sums_equal"] and tw["params_differ"] == [], f"{where}: trainer_writes differs {tw}"
        assert r["bad"] in r["nan_writes_error"] and "not finite" in r["nan_writes_error"], f"{where}: {r}"
        if kernel:
            assert r["torch_copies"] == 0 and 1 <= r["quant_launches"] <= 2 * r["buckets"], f"{where}: {r}"
        else:
            assert r["quant_launches"] == 0, f"{where}: {r}"
        apart += r["scale_apart"]
    assert apart > 0, f"{family}: no case put a scale in another bucket than its weight"


def _own_reports(layouts: list[list[str]], nranks: int, tmp_path) -> list[dict]:
    """Every layout (its script arguments) run in turn in one torchrun launch of `nranks` ranks: each
    launch pays megatron's imports in every rank. Per layout, rank -> family -> case -> report."""
    out = tmp_path / "report.json"
    args = ["--out", str(out)]
    for i, layout in enumerate(layouts):
        args += [*(["--then"] if i else []), *layout]
    proc = torchrun(SUPPORT / "_flat_export_pp_cases.py", nranks, args, timeout=600 * len(layouts))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert sorted(report) == [str(r) for r in range(nranks)]
    assert all(len(by_layout) == len(layouts) for by_layout in report.values()), layouts
    return [{rank: by_layout[i] for rank, by_layout in report.items()} for i in range(len(layouts))]


def _check_own(report: dict, family: str, layout: str) -> dict[str, dict[str, list[str]]]:
    """Every rank's every case took the flat path and matched its packed own export and the checkpoint
    byte for byte; across the ranks every tensor of the model is sent exactly once. case -> rank -> names."""
    cases: dict[str, dict[str, list[str]]] = {}
    nranks = len(report)
    for rank, rep in report.items():
        rep = dict(rep[family])
        assert rep.pop("cast_flat_is_none") is True, f"{family} rank {rank}: a casting export must pack"
        for case, r in rep.items():
            where = f"{family} {case} {layout} rank {rank}"
            assert "error" not in r, f"{where}: {r['error']}"
            assert r["senders"] == list(range(nranks)) and r["buckets"] > 0, f"{where}: {r}"
            assert r["flat"], f"{where}: the rank did not take the flat path"
            assert r["iter_vs_hf"] == [], f"{where}: the own export differs from the checkpoint {r}"
            assert r["flat_vs_iter"] == [] and r["flat_vs_hf"] == [], f"{where}: flat buckets differ {r}"
            assert r["aliased_bytes"] + r["copied_bytes"] == r["total_bytes"], where
            # a grouped layout's experts are views of weight1/weight2, copied: an EP rank with experts
            # alone aliases nothing
            assert r["aliased_bytes"] > 0 or case.startswith("grouped-"), where
            assert r["reused"], f"{where}: a second sync of the same layout planned again"
            assert r["after_step_changed"] and r["after_step_vs_iter"] == [], f"{where}: after a step {r}"
            assert r["replanned"] and r["stale_vs_iter"] == [], f"{where}: a parameter with new storage {r}"
            assert r["whole_is_none"], f"{where}: the whole-model flat_buckets is for TP=PP=EP=1 only"
            cases.setdefault(case, {})[rank] = r["names"]
    for case, by_rank in cases.items():
        names = [n for ns in by_rank.values() for n in ns]
        # every tensor of the model sent by exactly one rank
        total = {report[r][family][case]["model_tensors"] for r in by_rank}
        assert len(names) == len(set(names)) and {len(names)} == total, f"{family} {case} {layout}: {total}"
        assert "model.embed_tokens.weight" in names and "model.norm.weight" in names, f"{family} {case}"
        assert any(n.startswith("model.layers.") for n in names), family
    return cases


PP_LAYOUTS = [(2, 1), (2, 2)]
EP_LAYOUTS = [(1, 2), (2, 2)]


@pytest.fixture(scope="module")
def moe_hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf-moe")
    return {f: str(save_random_hf(make_config(f), root / f, seed=20 + i)) for i, f in enumerate(MOE_FAMILIES)}


@pytest.fixture(scope="module")
def own_reports(hf_dirs, moe_hf_dirs, tmp_path_factory) -> Callable[[tuple[str, int, int]], dict]:
    """("pp"|"ep", pp, vpp|ep) -> the layout's report. The 2-rank layouts (both PP ones and EP=2 at
    PP=1) run in one torchrun launch; PP=2 x EP=2 (4 ranks) in another, on its first use."""
    dense = [f"{f}={hf_dirs[f]}" for f in FAMILIES]
    moe = [f"{f}={d}" for f, d in moe_hf_dirs.items()]
    layouts = {("pp", p, v): ["--pp", str(p), "--vpp", str(v), *dense] for p, v in PP_LAYOUTS}
    layouts |= {("ep", p, e): ["--pp", str(p), "--ep", str(e), *moe] for p, e in EP_LAYOUTS}
    reports: dict = {}

    def get(key):
        if key not in reports:
            nranks = key[1] * (key[2] if key[0] == "ep" else 1)
            keys = [k for k in layouts if k[1] * (k[2] if k[0] == "ep" else 1) == nranks]
            tmp = tmp_path_factory.mktemp(f"own-world{nranks}")
            try:
                reports.update(zip(keys, _own_reports([layouts[k] for k in keys], nranks, tmp)))
            except AssertionError as exc:  # a failed launch fails each of its layouts' tests, run once
                reports.update(dict.fromkeys(keys, exc))
        if isinstance(reports[key], AssertionError):
            raise reports[key]
        return reports[key]

    return get


@pytest.mark.parametrize("pp,vpp", PP_LAYOUTS, ids=[f"pp{p}-vpp{v}" for p, v in PP_LAYOUTS])
def test_each_stage_flat_buckets_are_its_packed_export_byte_for_byte(pp, vpp, own_reports):
    """Pipeline stages (multi-sender, TP=EP=1): each rank's flat buckets over the buckets it owns
    (`own_flat_buckets`) are its own per-tensor export packed, and the checkpoint, byte for byte;
    before and after a step, and replanned for a parameter given new storage. The stages together
    cover every tensor once (a tied embedding on stage 0 alone)."""
    report = own_reports(("pp", pp, vpp))
    for family in FAMILIES:
        _check_own(report, family, f"pp{pp} vpp{vpp}")


@pytest.mark.parametrize("pp,ep", EP_LAYOUTS, ids=[f"pp{p}-ep{e}" for p, e in EP_LAYOUTS])
def test_each_expert_rank_flat_buckets_are_its_packed_export_byte_for_byte(pp, ep, own_reports):
    """Expert-parallel ranks of MoE models (multi-sender, TP = expert-TP = 1): as the stages above, each
    rank's flat buckets are its own packed export and the checkpoint, byte for byte. Megatron's rank
    order at TP=1: stage s holds ranks s*ep .. s*ep+ep-1, and EP rank e of a stage sends that stage's
    experts e*E/ep .. (e+1)*E/ep-1 (global numbering), its dense leader (EP rank 0) the dense tensors
    too (the other EP ranks hold replicas of them, sent by no one else). The bf16 cases also run in the
    grouped layout, whose experts are views into weight1/weight2: weight1 given new storage makes the
    plan stale (its views would keep the old address) and the next buckets follow it."""
    report = own_reports(("ep", pp, ep))
    for family in MOE_FAMILIES:
        per_expert = MOE_FAMILIES[family]["num_experts"] // ep
        for rank, rep in report.items():
            grouped = [c for c in rep[family] if c.startswith("grouped-")]
            assert len(grouped) == 2, f"{family} rank {rank}: the grouped cases did not run {sorted(rep[family])}"
        for case, by_rank in _check_own(report, family, f"pp{pp} ep{ep}").items():
            for rank, names in by_rank.items():
                ep_rank = int(rank) % ep
                experts = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n}
                where = f"{family} {case} pp{pp} ep{ep} rank {rank}"
                assert experts and {e // per_expert for e in experts} == {ep_rank}, f"{where}: experts {experts}"
                dense = [n for n in names if ".mlp.experts." not in n]
                assert bool(dense) == (ep_rank == 0), f"{where}: dense tensors {dense[:3]}"
