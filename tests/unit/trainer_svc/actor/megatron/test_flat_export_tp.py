"""The flat export at TP > 1 (flat_export.py with tp_gather.py's exchange), under torchrun on gloo:
every stage leader's buckets, written from its own shards and the ones its TP group sends, are its
per-tensor export packed by the pipeline and the HF checkpoint, byte for byte; after a step; after a
sharded parameter got new storage on every rank (the leader replans); with a TP rank declining (the
whole group exports and nobody waits). qwen2 has a QKV bias and a padded vocabulary (the remote
vocabulary shard holds padding rows: it lands in the gather buffer); the tied qwen2 here has a
vocabulary of 512 = 2 * 256 rows, unpadded at TP=2, so the remote embedding shard lands straight in
its slot. At PP=1 also rank 0's whole-model `flat_buckets` (the single sender) with the other rank
serving its worker loop."""

from __future__ import annotations

import pytest

from tests.support.flat_tp_report import check_tp_report, save_tp_models, tp_report, tp_reports
from tests.support.megatron_models import MOE_FAMILIES, make_config, save_random_hf


@pytest.fixture(scope="module")
def tp_hf_dirs(tmp_path_factory) -> dict[str, str]:
    return save_tp_models(tmp_path_factory.mktemp("hf-tp"))


@pytest.fixture(scope="module")
def world4_reports(tp_hf_dirs, tmp_path_factory) -> dict[str, dict]:
    """TP=2 x PP=2 (dense) and TP=2 x EP=2 (MoE, unsplit experts), 4 ranks each: one torchrun launch
    runs both (each launch pays megatron's imports in every rank). layout -> report by rank."""
    root = tmp_path_factory.mktemp("hf-moe-tp")
    moe = {f: str(save_random_hf(make_config(f), root / f, seed=40 + i)) for i, f in enumerate(MOE_FAMILIES)}
    layouts = {
        "tp2-pp2": (tp_hf_dirs, ["--tp", "2", "--pp", "2", "--cases", "1"]),
        "tp2-ep2": (moe, ["--tp", "2", "--ep", "2", "--etp", "1", "--cases", "0"]),
    }
    reports = tp_reports(list(layouts.values()), tmp_path_factory.mktemp("world4"), 4)
    return dict(zip(layouts, reports))


def test_tp2_flat_buckets_are_the_packed_export_byte_for_byte(tp_hf_dirs, tmp_path):
    leaders = check_tp_report(tp_report(tp_hf_dirs, tmp_path, 2, ["--tp", "2"]), tp=2, pp=1)
    for (family, case), by_rank in leaders.items():
        r = by_rank["0"]
        # the tied 512-row vocabulary's second shard is HF rows 256..511: received into its slot;
        # qwen2's second shard holds the padding rows past 250: received into the buffer
        hidden = 64
        itemsize = 4 if case.startswith("float32") else 2
        want = 256 * hidden * itemsize if family == "qwen2-tied-512" else 0
        assert r["landed_bytes"] == want, f"{family} {case}: {r}"
        assert all(x["launches"] == 0 and x["torch_copies"] == x["copies"] for x in by_rank.values())


def test_tp2_pp2_each_stage_leader_writes_its_flat_buckets(world4_reports):
    """Two stages of two TP ranks (multi-sender): each stage leader's buckets, from its TP group."""
    leaders = check_tp_report(world4_reports["tp2-pp2"], tp=2, pp=2)
    for (family, _), by_rank in leaders.items():
        assert sorted(by_rank) == ["0", "2"], family
        names = [n for r in by_rank.values() for n in r["names"]]
        assert len(names) == len(set(names)) == by_rank["0"]["model_tensors"], family


def test_tp2_ep2_an_expert_rank_beside_the_stage_leader_writes_its_own(world4_reports):
    """MoE at TP=2 x EP=2 with unsplit experts (expert-TP=1), 4 ranks: megatron puts EP rank 1 on TP
    rank 1 of the stage (rank 1), which sends its dense shards to rank 0 and writes its own experts'
    buckets from its own parameters; ranks 2-3 (the second dense replica) hold nothing to send and
    export (no collective). Every sender's buckets are its packed export, byte for byte."""
    report = world4_reports["tp2-ep2"]
    for (family, case), by_rank in check_tp_report(report, tp=2, pp=1, ep=2, senders=[0, 1]).items():
        experts = {r: {n.split(".")[5] for n in x["names"] if ".mlp.experts." in n} for r, x in by_rank.items()}
        assert experts["0"] and experts["1"] and not experts["0"] & experts["1"], f"{family} {case}: {experts}"
        assert all(".mlp.experts." in n for n in by_rank["1"]["names"]), f"{family} {case}: dense on rank 1"


@pytest.mark.slow  # the Triton interpreter: about 50 s on 2 cores
def test_tp2_flat_buckets_through_the_copy_kernel(tp_hf_dirs, tmp_path):
    """The copies from the gather buffer and the leader's own shards by the Triton copy kernel (its
    interpreter here), as on a GPU: every pair taken by the table, a launch or a few per sync; the
    tied model, whose embedding shard lands in its slot and whose other shards in the buffer."""
    pytest.importorskip("triton")
    env = {"FLAT_CASES_KERNEL": "1", "TRITON_INTERPRET": "1"}
    report = tp_report(tp_hf_dirs, tmp_path, 2, ["--tp", "2", "--cases", "0"], env, only={"qwen2-tied-512"})
    for (family, case), by_rank in check_tp_report(report, tp=2, pp=1).items():
        r = by_rank["0"]
        assert r["torch_copies"] == 0 and 1 <= r["launches"] <= 4, f"{family} {case}: {r}"
