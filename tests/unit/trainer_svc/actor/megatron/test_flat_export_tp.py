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

import json

import pytest

from tests.support.megatron_models import SUPPORT, make_config, save_random_hf, torchrun


@pytest.fixture(scope="module")
def tp_hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf-tp")
    configs = {"qwen2": make_config("qwen2"), "qwen2-tied-512": make_config("qwen2-tied", vocab_size=512)}
    return {f: str(save_random_hf(c, root / f, seed=30 + i)) for i, (f, c) in enumerate(configs.items())}


def _report(tp_hf_dirs, tmp_path, nranks: int, args: list[str], env: dict | None = None, only=None) -> dict:
    out = tmp_path / "report.json"
    dirs = [f"{f}={d}" for f, d in tp_hf_dirs.items() if only is None or f in only]
    proc = torchrun(SUPPORT / "_flat_export_tp_cases.py", nranks, ["--out", str(out), *args, *dirs], 600, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert sorted(report) == [str(r) for r in range(nranks)]
    return report


def _check(report: dict, tp: int, pp: int) -> dict:
    """Every case on every rank took the flat path and matched; the leaders' plans. case -> rank -> r."""
    leaders: dict = {}
    for rank, by_family in report.items():
        leader = int(rank) % tp == 0
        for family, rep in by_family.items():
            rep = dict(rep)
            assert rep.pop("cast_flat_is_none") is True, f"{family} rank {rank}: a casting export must pack"
            for case, r in rep.items():
                where = f"{family} {case} tp{tp} pp{pp} rank {rank}"
                assert "error" not in r, f"{where}: {r['error']}"
                assert r["senders"] == [s * tp for s in range(pp)], f"{where}: {r}"
                assert (r["buckets"] > 0) == leader, f"{where}: only the stage leaders own buckets {r}"
                assert r["flat"], f"{where}: the group did not take the flat path"
                assert r["iter_vs_hf"] == [], f"{where}: the own export differs from the checkpoint {r}"
                assert r["flat_vs_iter"] == [] and r["flat_vs_hf"] == [], f"{where}: flat buckets differ {r}"
                assert r["reused"], f"{where}: a second sync of the same layout planned again"
                assert r["after_step_changed"] and r["after_step_vs_iter"] == [], f"{where}: after a step {r}"
                assert r["replanned"] and r["stale_vs_iter"] == [], f"{where}: new storage {r}"
                assert r["declined"] and r["after_decline_vs_iter"] == [], f"{where}: a declining rank {r}"
                if not leader:
                    continue
                assert r["aliased_bytes"] + r["copied_bytes"] + r["landed_bytes"] == r["total_bytes"], where
                assert r["received_bytes"] > 0 and r["copies"] > 0, where
                # every remote shard lands in the persistent buffer or its slot, nothing else
                assert r["received_bytes"] == r["gather_buffer_bytes"] + r["landed_bytes"], where
                if pp == 1:
                    f = r["funnel"]
                    assert f["flat"] and f["flat_vs_iter"] == [] and f["reused"] and f["again_vs_iter"] == [], where
                leaders.setdefault((family, case), {})[rank] = r
    return leaders


def test_tp2_flat_buckets_are_the_packed_export_byte_for_byte(tp_hf_dirs, tmp_path):
    leaders = _check(_report(tp_hf_dirs, tmp_path, 2, ["--tp", "2"]), tp=2, pp=1)
    for (family, case), by_rank in leaders.items():
        r = by_rank["0"]
        # the tied 512-row vocabulary's second shard is HF rows 256..511: received into its slot;
        # qwen2's second shard holds the padding rows past 250: received into the buffer
        hidden = 64
        itemsize = 4 if case.startswith("float32") else 2
        want = 256 * hidden * itemsize if family == "qwen2-tied-512" else 0
        assert r["landed_bytes"] == want, f"{family} {case}: {r}"
        assert all(x["launches"] == 0 and x["torch_copies"] == x["copies"] for x in by_rank.values())


def test_tp2_pp2_each_stage_leader_writes_its_flat_buckets(tp_hf_dirs, tmp_path):
    """Two stages of two TP ranks (multi-sender): each stage leader's buckets, from its TP group."""
    leaders = _check(_report(tp_hf_dirs, tmp_path, 4, ["--tp", "2", "--pp", "2", "--cases", "1"]), tp=2, pp=2)
    for (family, _), by_rank in leaders.items():
        assert sorted(by_rank) == ["0", "2"], family
        names = [n for r in by_rank.values() for n in r["names"]]
        assert len(names) == len(set(names)) == by_rank["0"]["model_tensors"], family


@pytest.mark.slow  # the Triton interpreter: about 50 s on 2 cores
def test_tp2_flat_buckets_through_the_copy_kernel(tp_hf_dirs, tmp_path):
    """The copies from the gather buffer and the leader's own shards by the Triton copy kernel (its
    interpreter here), as on a GPU: every pair taken by the table, a launch or a few per sync; the
    tied model, whose embedding shard lands in its slot and whose other shards in the buffer."""
    pytest.importorskip("triton")
    env = {"FLAT_CASES_KERNEL": "1", "TRITON_INTERPRET": "1"}
    report = _report(tp_hf_dirs, tmp_path, 2, ["--tp", "2", "--cases", "0"], env, only={"qwen2-tied-512"})
    for (family, case), by_rank in _check(report, tp=2, pp=1).items():
        r = by_rank["0"]
        assert r["torch_copies"] == 0 and 1 <= r["launches"] <= 4, f"{family} {case}: {r}"
