"""The TP flat-export cases (_flat_export_tp_cases.py) as the CPU and GPU tests run and check them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.megatron_models import SUPPORT, make_config, save_random_hf, torchrun


def save_tp_models(root: Path) -> dict[str, str]:
    """qwen2 (QKV bias, untied, a vocabulary of 250 padded to 256 at TP=2: the remote shard holds
    padding rows) and a tied qwen2 of 512 = 2 * 256 rows (unpadded at TP=2: the remote embedding
    shard lands in its slot). family -> HF dir."""
    configs = {"qwen2": make_config("qwen2"), "qwen2-tied-512": make_config("qwen2-tied", vocab_size=512)}
    return {f: str(save_random_hf(c, root / f, seed=30 + i)) for i, (f, c) in enumerate(configs.items())}


def tp_report(tp_hf_dirs, tmp_path, nranks: int, args: list[str], env: dict | None = None, only=None) -> dict:
    """Run the cases under torchrun (`nranks` ranks) on `tp_hf_dirs` (family -> HF dir); the report by rank."""
    dirs = {f: d for f, d in tp_hf_dirs.items() if only is None or f in only}
    return tp_reports([(dirs, args)], tmp_path, nranks, env)[0]


def tp_reports(layouts: list[tuple[dict, list[str]]], tmp_path, nranks: int, env: dict | None = None) -> list[dict]:
    """Several layouts of one world size, each (family -> HF dir, its arguments), run in turn in one
    torchrun launch (each launch pays megatron's imports in every rank): per layout, the report by rank."""
    out = tmp_path / "report.json"
    argv = ["--out", str(out)]
    for i, (dirs, args) in enumerate(layouts):
        argv += [*(["--then"] if i else []), *args, *(f"{f}={d}" for f, d in dirs.items())]
    proc = torchrun(SUPPORT / "_flat_export_tp_cases.py", nranks, argv, 600 * len(layouts), env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert sorted(report) == [str(r) for r in range(nranks)]
    assert all(len(by_layout) == len(layouts) for by_layout in report.values()), [a for _, a in layouts]
    return [{rank: by_layout[i] for rank, by_layout in report.items()} for i in range(len(layouts))]


def check_tp_report(report: dict, tp: int, pp: int, ep: int = 1, senders: list[int] | None = None) -> dict:
    """Every case matched on every rank, and every rank that sends or serves a sender took the flat
    path (a rank of another dense replica without buckets exports: it runs no collective). The
    senders' plans: (family, case) -> rank -> report. `senders`: default, the stage leaders."""
    senders = [s * tp for s in range(pp)] if senders is None else senders
    plans: dict = {}
    for rank, by_family in report.items():
        sender = int(rank) in senders
        for family, rep in by_family.items():
            rep = dict(rep)
            assert rep.pop("cast_flat_is_none") is True, f"{family} rank {rank}: a casting export must pack"
            for case, r in rep.items():
                where = f"{family} {case} tp{tp} pp{pp} ep{ep} rank {rank}"
                assert "error" not in r, f"{where}: {r['error']}"
                assert r["senders"] == senders and (r["buckets"] > 0) == sender, f"{where}: {r}"
                assert r["iter_vs_hf"] == [], f"{where}: the own export differs from the checkpoint {r}"
                if not (sender or r["replica0"]):
                    assert not r["flat"], f"{where}: {r}"
                    continue
                assert r["flat"], f"{where}: the group did not take the flat path"
                assert r["flat_vs_iter"] == [] and r["flat_vs_hf"] == [], f"{where}: flat buckets differ {r}"
                assert r["reused"], f"{where}: a second sync of the same layout planned again"
                assert r["after_step_changed"] and r["after_step_vs_iter"] == [], f"{where}: after a step {r}"
                assert r["replanned"] and r["stale_vs_iter"] == [], f"{where}: new storage {r}"
                assert r["declined"] and r["after_decline_vs_iter"] == [], f"{where}: a declining rank {r}"
                assert ("funnel" in r) == (r["tp_rank"] == 0 and pp == ep == 1) or not sender, where
                if not sender:
                    continue
                assert r["aliased_bytes"] + r["copied_bytes"] + r["landed_bytes"] == r["total_bytes"], where
                if r["tp_rank"] == 0:
                    assert r["received_bytes"] > 0 and r["copies"] > 0, where
                    # every remote shard lands in the persistent buffer or its slot, nothing else
                    assert r["received_bytes"] == r["gather_buffer_bytes"] + r["landed_bytes"], where
                else:  # a TP rank > 0 sends its own buckets (an EP rank's unsplit experts): nothing to receive
                    assert r["received_bytes"] == 0, where
                if "funnel" in r:
                    f = r["funnel"]
                    assert f["flat"] and f["flat_vs_iter"] == [] and f["reused"] and f["again_vs_iter"] == [], where
                plans.setdefault((family, case), {})[rank] = r
    return plans
