"""Fleet cost model: parameter counts, calibration against the recorded GPU runs, and its invariants."""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # bench/ is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import cost_calibration as calib  # noqa: E402
from bench.cost_model import CAL, MULTI, SINGLE, Fleet, Links, Sync, Trainer, main, predict  # noqa: E402
from bench.model_arch import ARCHS, BF16, FP8, Tensor, arch, footprint, tensor_bytes  # noqa: E402


@pytest.mark.parametrize("name", [n for n, a in ARCHS.items() if a.published_total])
def test_parameter_totals_within_2_percent_of_published(name):
    a = ARCHS[name]
    got = footprint(a).params
    assert abs(got / a.published_total - 1) < 0.02, f"{name}: {got / 1e9:.2f}B vs {a.published_total / 1e9}B"
    assert abs(footprint(a).active_params / a.published_active - 1) < 0.05


def test_qwen3_30b_count_is_exact_sum_of_its_tensors():
    # 48 layers x (attention 18,874,624 + qk norms 256 + 2 layernorms 4096 + router 262,144
    # + 128 experts x 3 x 2048 x 768) + embedding + lm_head + final norm
    layer = 2048 * 4096 * 2 + 2048 * 512 * 2 + 256 + 4096 + 128 * 2048 + 128 * 3 * 2048 * 768
    assert footprint(arch("qwen3-30b-a3b")).params == 48 * layer + 2 * 151936 * 2048 + 2048


def test_fp8_block_bytes():
    t = Tensor((4096, 1536), linear=True)
    assert tensor_bytes(t, BF16) == 2 * 4096 * 1536
    assert tensor_bytes(t, FP8) == 4096 * 1536 + 4 * 32 * 12  # e4m3 + one fp32 scale per 128x128 block
    assert tensor_bytes(Tensor((4096,), linear=False), FP8) == 2 * 4096  # norms stay bf16
    ratio = footprint(arch("qwen3-235b-a22b"), FP8).bytes / footprint(arch("qwen3-235b-a22b"), BF16).bytes
    assert 0.5 < ratio < 0.51


def test_calibration_models_have_the_recorded_bytes_and_tensor_counts():
    runs = json.loads((calib.HISTORY / "results_services_nccl_phases_2xh200_2026-11-23.json").read_text())["models"]
    runs += json.loads((calib.HISTORY / "results_2xh200_2026-11-23.json").read_text())["nccl_1to1"]
    assert len(runs) == 4
    for r in runs:
        fp = footprint(arch(f"qwen2.5-{r['model']}"))
        assert fp.bytes == r["bytes"]
        assert fp.tensors == r.get("tensors", r.get("syncs", [{}])[-1].get("num_tensors"))


def test_every_recorded_1_to_1_gpu_run_predicted_within_15_percent():
    points = calib.all_points()
    kinds = {p.label.split()[0] for p in points}
    assert len(points) >= 11 and kinds == {"bus", "services"}
    bad = [(p.label, round(p.error(), 3)) for p in points if abs(p.error()) > 0.15]
    assert not bad, f"calibration broken: {bad}"


def test_fitted_constants_are_what_the_recorded_runs_give():
    assert calib.fit_per_tensor() == pytest.approx(CAL.per_tensor_s, rel=0.05)
    bucket, rpc = calib.fit_ipc()
    assert bucket == pytest.approx(CAL.ipc_bucket_s, rel=0.05)
    assert rpc == pytest.approx(CAL.ipc_rpc_bucket_s, rel=0.05)


def test_link_constants_reproduce_the_nccl_message_size_curve():
    for size, gbs in calib.MESSAGE_CURVE.items():
        t = CAL.msg_latency_s + size / (Links().nvlink_gbs * 1e9)
        assert size / t / 1e9 == pytest.approx(gbs, rel=0.02), size
    for r in json.loads((calib.HISTORY / "results_2xh200_2026-11-23.json").read_text())["nccl_1to1"]:
        n = math.ceil(r["bytes"] / (1 << 30))  # raw: the same bytes in 1 GiB messages
        predicted = n * CAL.msg_latency_s + r["bytes"] / (Links().nvlink_gbs * 1e9)
        assert predicted == pytest.approx(sorted(r["raw_s_rx"])[1], rel=0.02)


def test_bandwidth_only_1_to_1_is_bytes_over_link_plus_bucket_latency():
    cal = replace(CAL, per_tensor_s=0.0, hbm_rw_gbs=1e12)
    fp = footprint(arch("qwen2.5-7b"))
    p = predict(fp, Trainer(gpus_per_node=1), Fleet(same_node=True), sync=Sync(checksum=False, services=False), cal=cal)
    assert p.seconds == pytest.approx(fp.bytes / 367e9 + 15 * 25e-6, rel=1e-6)
    assert p.binding == "sender egress"


def test_receiver_modes_divide_ingress_as_documented():
    fp, links = footprint(arch("qwen3-235b-a22b")), Links()
    tr = Trainer(tp=4, pp=8, ep=8, nodes=8)
    full = predict(fp, tr, Fleet(replicas=8, tp=8, receiver="full"), links)
    shard = predict(fp, tr, Fleet(replicas=8, tp=8, receiver="shard"), links)
    net = links.net_gbs() * 1e9
    assert full.terms["receiver ingress"] == pytest.approx(fp.bytes / net)
    assert shard.terms["receiver ingress"] == pytest.approx(fp.bytes / 8 / net)
    with pytest.raises(ValueError, match="receiver=split"):
        predict(fp, tr, Fleet(replicas=2, tp=16, receiver="split"), links)


LAYOUTS = [
    Trainer(tp=1, pp=1, ep=8, nodes=1),
    Trainer(tp=2, pp=2, ep=4, nodes=2),
    Trainer(tp=4, pp=4, ep=8, nodes=4),
    Trainer(tp=4, pp=8, ep=8, nodes=8),
    Trainer(tp=2, pp=8, ep=16, nodes=32),
    Trainer(tp=8, pp=2, ep=1, nodes=2),
]
FLEETS = [
    Fleet(replicas=1, tp=1),
    Fleet(replicas=4, tp=2),
    Fleet(replicas=8, tp=8),
    Fleet(replicas=8, tp=16),
    Fleet(replicas=32, tp=4),
]


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3-235b-a22b", "kimi-k2", "qwen2.5-32b"])
def test_multi_sender_never_slower_than_single_sender(model):
    a = arch(model)
    checked = 0
    for tr, fl, dtype, rx, bucket in itertools.product(
        LAYOUTS, FLEETS, (BF16, FP8), ("full", "shard"), (256 << 20, 1 << 30)
    ):
        if not a.moe:
            tr = replace(tr, ep=1)
        fleet, sync = replace(fl, receiver=rx), Sync(bucket_bytes=bucket)
        one = predict(footprint(a, dtype), tr, fleet, sync=sync, mode=SINGLE)
        many = predict(footprint(a, dtype), tr, fleet, sync=sync, mode=MULTI)
        assert many.seconds <= one.seconds * (1 + 1e-9), (model, tr, fleet, dtype, bucket)
        checked += 1
    assert checked == len(LAYOUTS) * len(FLEETS) * 8


def test_more_trainer_nodes_help_multi_sender_until_the_fleet_ingress_bounds_it():
    fp = footprint(arch("qwen3-235b-a22b"))
    fleet = Fleet(replicas=2, tp=32, receiver="shard")
    multi, single = [], []
    for nodes in (1, 2, 4, 8, 16):
        tr = Trainer(tp=4, pp=nodes, ep=8, nodes=nodes)
        multi.append(predict(fp, tr, fleet, mode=MULTI))
        single.append(predict(fp, tr, fleet, mode=SINGLE).stream_s)
    t = [p.stream_s for p in multi]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(t, t[1:]))
    assert t[1] < 0.6 * t[0] and t[2] < 0.6 * t[1]  # sender-bound: halves with the nodes
    assert multi[0].binding == "sender egress" and multi[-1].binding == "receiver ingress"
    assert t[-1] == pytest.approx(t[-2], rel=0.02)  # flat once the receivers bound it
    assert max(single) / min(single) < 1.01  # one link: nodes do not help a single sender
    assert single[-1] > 20 * t[-1]


def test_bad_layouts_name_the_field():
    fp = footprint(arch("qwen3-235b-a22b"))
    with pytest.raises(ValueError, match="tp=16 > gpus_per_node=8"):
        predict(fp, Trainer(tp=16, nodes=2), Fleet())
    with pytest.raises(ValueError, match="ep=3"):
        predict(fp, Trainer(ep=3), Fleet())
    with pytest.raises(ValueError, match="ep=2 on a dense model"):
        predict(footprint(arch("qwen2.5-7b")), Trainer(ep=2), Fleet())
    with pytest.raises(ValueError, match="receiver='all'"):
        predict(fp, Trainer(), Fleet(receiver="all"))
    with pytest.raises(ValueError, match="transport ipc: colocated 1 -> 1"):
        predict(fp, Trainer(), Fleet(), sync=Sync(transport="ipc"))
    with pytest.raises(ValueError, match="model 'gpt-5'"):
        arch("gpt-5")


def test_cli(capsys):
    assert (
        main(["--model", "qwen3-30b-a3b", "--trainer", "tp=1,ep=8", "--fleet", "replicas=4,tp=2,receiver=shard"]) == 0
    )
    out = capsys.readouterr().out
    assert "single-sender: sync" in out and "multi-sender: sync" in out and "8 sender(s)" in out
    assert main(["--trainer", "tp=16"]) == 2
    with pytest.raises(SystemExit, match="unknown key 'cp'"):
        main(["--trainer", "cp=2"])
    assert main(["--calibration"]) == 0
    assert "services 7B NCCL" in capsys.readouterr().out


def test_control_cost_is_measured_at_scale_or_predicted_per_bucket():
    from bench import control_measured
    from bench.cost_model import GIB, control_seconds, control_source

    small, big = footprint(arch("qwen2.5-7b")), footprint(arch("kimi-k2"), FP8)
    base = CAL.plan_prepare_s + CAL.commit_s
    # the reference: its own measured control, nothing added
    assert control_seconds(small) == pytest.approx(base) and control_source(small) == "predicted"
    measured = control_measured.row("kimi-k2", FP8)
    assert measured is not None and measured.tensors == big.tensors == 139523
    assert control_seconds(big) == pytest.approx(base + measured.steady_s) and control_source(big) == "measured"
    # an unmeasured model: per bucket beyond the reference's 15
    mid = footprint(arch("qwen3-30b-a3b"))
    extra = control_measured.buckets(mid.bytes, GIB) - 15
    assert extra > 0
    assert control_seconds(mid) == pytest.approx(base + control_measured.per_bucket_s() * extra)
    assert 0 < control_measured.per_bucket_s() < 1e-3  # well under a millisecond per bucket


def test_a_tp2_sglang_run_becomes_a_sharded_receiver_point_with_its_bytes_per_rank(tmp_path):
    import json

    from bench import cost_tables
    from bench.cost_calibration import shard_points

    assert shard_points(tmp_path) == []
    assert "no SGLang run with tp_size=2" in cost_tables.shard_markdown([])
    assert "not yet checked against a run" in cost_tables.anchors_markdown([])
    total = footprint(arch("qwen2.5-7b")).bytes
    rows = [
        {"model": "7b", "transport": "nccl", "tp_size": 2, "sync_s": 0.060, "bytes_per_rank": total / 2},
        {"model": "7b", "transport": "nccl", "tp_size": 2, "sync_s": 0.090, "bytes_per_rank": total},
        {"model": "7b", "transport": "ipc", "tp_size": 2, "sync_s": 0.020, "bytes_per_rank": total},  # one GPU
        {"model": "7b", "transport": "nccl", "tp_size": 1, "sync_s": 0.050, "bytes_per_rank": total},  # a pair
    ]
    (tmp_path / "sglang_live_2xh200_2026-11-29.json").write_text(json.dumps({"rows": rows}))
    shard, full = shard_points(tmp_path)
    assert (shard.fleet.receiver, shard.fleet.tp, full.fleet.receiver) == ("shard", 2, "full")
    assert shard.predicted_rank_bytes() == pytest.approx(total / 2) and full.predicted_rank_bytes() == total
    assert shard.measured_s == 0.060 and shard.source.endswith("rows[0].sync_s")
    # half the bytes into each of the two GPUs (one sender: its egress still binds both streams)
    fp, one = footprint(arch("qwen2.5-7b")), Trainer(nodes=1, gpus_per_node=1)
    rx = {p.fleet.receiver: predict(fp, one, p.fleet, sync=p.sync).terms["receiver ingress"] for p in (shard, full)}
    assert rx["shard"] == pytest.approx(rx["full"] / 2)
    assert shard.error() == pytest.approx(shard.predicted_s() / 0.060 - 1)
    table = cost_tables.shard_markdown([shard, full])
    assert "| SGLang 7B NCCL, tp_size=2 (shard receiver) | qwen2.5-7b | 60.0 ms |" in table
    assert f"{total / 2e9:.2f} GB" in table
    assert "shard receivers checked against SGLang 7B NCCL" in cost_tables.anchors_markdown([shard])
    (tmp_path / "sglang_live_2xh200_2026-11-30.json").write_text(
        json.dumps({"rows": [dict(rows[0], bytes_per_rank=None)]})
    )
    with pytest.raises(ValueError, match="must record bytes_per_rank"):
        shard_points(tmp_path)


def test_a_shard_point_far_off_the_model_checks_its_bytes_per_rank_only(tmp_path):
    """The recorded tp_size=2 run: per-rank bytes as a list (RolloutSyncResult.bytes_per_rank), a token-check row
    without a model skipped, and a time far off the model said not to check the receiver's time."""
    import json

    from bench import cost_tables
    from bench.cost_calibration import shard_points

    half = footprint(arch("qwen2.5-7b")).bytes / 2
    rows = [
        {"transport": "nccl", "tp_size": 2, "sync_s": 0.018, "bytes_per_rank": [1, 1]},  # the peaked model's check
        {"model": "7b", "transport": "nccl", "tp_size": 2, "sync_s": 0.99, "bytes_per_rank": [half, half]},
    ]
    (tmp_path / "sglang_live_2xh200_2026-11-28.json").write_text(json.dumps({"rows": rows}))
    (point,) = shard_points(tmp_path)
    assert point.fleet.receiver == "shard" and point.source.endswith("rows[1].sync_s")
    assert point.error() < -0.5
    text = cost_tables.anchors_markdown([point])
    assert "bytes per rank checked against SGLang 7B NCCL, tp_size=2 (shard receiver), its time not" in text
    assert "shard receivers checked against" not in text
