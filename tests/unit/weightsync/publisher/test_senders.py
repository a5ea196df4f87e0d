"""The orchestrator's choice of senders and its merge of their reports, with a fake two-rank actor
(the torchrun version runs in tests/e2e/test_multisender_e2e.py)."""

import threading
import time

import pytest
import torch

from weightsync.bus.channel import BucketSender
from weightsync.bus.plan import TensorMeta
from weightsync.bus.tcp.wire import hello_mac
from weightsync.bus.transports import multi_sender_names
from weightsync.obs.metrics import SyncMetrics
from weightsync.publisher.multisender import RANK_ENDS, SenderResult, SendJob, _bus_sender
from weightsync.publisher.orchestrator import SyncOrchestrator
from weightsync.publisher.registry import RolloutEntry
from weightsync.publisher.source import WeightSource
from weightsync.sync_options import SyncOptions
from weightsync.v1 import rollout_pb2

METAS = [TensorMeta(f"w{i}", (64,), torch.float32) for i in range(4)]
OWNERS = [0, 0, 1, 1]


class TwoRankActor(WeightSource):
    """Owns w0, w1 on rank 0 and w2, w3 on rank 1; `run_senders` answers with canned reports."""

    family, version = "fake", 3

    def __init__(self, rank1=None):
        self.rank1 = rank1 or {}
        self.jobs, self.funnelled = [], 0
        self.export_stats = {}

    def export_metas(self):
        return list(METAS)

    def export_owners(self):
        return list(OWNERS)

    def export_tensors(self):  # the funnel: rank 0 yields everything, having received rank 1's half
        self.funnelled += 1
        self.export_stats = {"forwarded_bytes": 2 * 64 * 4}
        return iter((m.name, torch.zeros(m.shape)) for m in METAS)

    def run_senders(self, job):
        self.jobs.append(SendJob.from_args(job))
        mine = [[0, 100], [1, 101]]
        ranks = [
            SenderResult(rank=0, buckets=2, bytes=512, seconds=0.5, checksums=mine, peak_buffer_bytes=512),
            SenderResult(
                **{
                    "rank": 1,
                    "buckets": 2,
                    "bytes": 512,
                    "seconds": 0.9,
                    "peak_buffer_bytes": 256,
                    "checksums": [[2, 102], [3, 103]],
                    **self.rank1,
                }
            ),
        ]
        return [r.__dict__ for r in ranks]


def _orch(actor, calls, **kw):
    o = SyncOrchestrator(
        actor,
        threading.Lock(),
        None,
        SyncMetrics("trainer"),
        token="tok",
        options=SyncOptions(bucket_bytes=256, transport="tcp", sync_timeout_s=30, rpc_timeout_s=5, **kw),
        origin="o",
    )

    def call(entry, method, req):
        calls.append((entry.rollout_id, method, req))
        if method == "PrepareSync":
            resp = rollout_pb2.PrepareSyncResponse()
            resp.transport.tcp.data_address = f"{entry.rollout_id}:9"
            return resp, ""
        if method == "CommitSync":
            return rollout_pb2.CommitSyncResponse(version=req.version), ""
        return rollout_pb2.AbortSyncResponse(), ""

    o.rollouts.call = call
    return o


def _targets():
    return [RolloutEntry("a", "a:1"), RolloutEntry("b", "b:1")]


def test_every_owner_streams_and_the_commit_carries_all_senders_checksums():
    calls, actor = [], TwoRankActor()
    orch = _orch(actor, calls)
    rep = orch.sync(_targets())
    assert rep.ok and actor.funnelled == 0
    (job,) = actor.jobs
    assert job.targets == {"a": "a:9", "b": "b:9"} and job.version == 3
    assert job.macs == {"0": hello_mac("tok", rep.sync_id, 0).hex(), "1": hello_mac("tok", rep.sync_id, 1).hex()}
    prepared = [req for _, m, req in calls if m == "PrepareSync"][0]
    assert [b.sender for b in prepared.manifest.buckets] == [0, 0, 1, 1]
    commit = [req for _, m, req in calls if m == "CommitSync"][0]
    assert [(c.index, c.checksum) for c in commit.checksums] == [(0, 100), (1, 101), (2, 102), (3, 103)]
    assert [(s.rank, s.bytes, s.seconds) for s in rep.senders] == [(0, 512, 0.5), (1, 512, 0.9)]
    m = orch.metrics
    assert m.sender_bytes.labels("trainer", "1")._value.get() == 512
    # each sender's pack buffers, in the report and as a gauge (its memory bound, per rank)
    assert [s.peak_buffer_bytes for s in rep.senders] == [512, 256]
    assert m.sender_buffer_bytes.labels("trainer", "1")._value.get() == 256


def test_a_rollout_one_sender_dropped_fails_alone_and_a_failed_sender_fails_all():
    calls = []
    rep = _orch(TwoRankActor({"failures": {"b": "TCP bus send failed"}}), calls).sync(_targets())
    ok = {r.rollout_id: r for r in rep.rollouts}
    assert ok["a"].ok and not ok["b"].ok and ok["b"].error == "sender rank 1: TCP bus send failed"
    assert [r for r, m, _ in calls if m == "AbortSync"] == ["b"]
    calls = []
    rep = _orch(TwoRankActor({"error": "rank 1: export failed", "checksums": []}), calls).sync(_targets())
    assert not any(r.ok for r in rep.rollouts) and all("rank 1: export failed" in r.error for r in rep.rollouts)
    assert not any(m == "CommitSync" for _, m, _ in calls)
    assert sorted(r for r, m, _ in calls if m == "AbortSync") == ["a", "b"]
    assert rep.senders[1].error == "rank 1: export failed"


def test_rank0_funnels_and_reports_what_was_forwarded_to_it():
    calls, actor = [], TwoRankActor()
    orch = _orch(actor, calls, senders="rank0")
    orch.transports["tcp"].begin = _fake_open(orch.transports["tcp"].begin)
    rep = orch.sync(_targets())
    assert actor.jobs == [] and actor.funnelled == 1
    assert [(s.rank, s.bytes, s.forwarded_bytes) for s in rep.senders] == [(0, 1024, 512)]
    prepared = [req for _, m, req in calls if m == "PrepareSync"][0]
    assert {b.sender for b in prepared.manifest.buckets} == {0}


def _fake_open(begin):
    """The funnel streams through the session's channel (tcp's, or rank 0's own nccl group): give it
    one that takes the bytes."""

    def wrapped(*a, **kw):
        session = begin(*a, **kw)

        class Sink(BucketSender):
            def send(self, plan, buf, checksum):
                pass

            def failures(self):
                return {}

            def close(self):
                pass

        session.open = lambda targets, timeout: Sink()
        return session

    return wrapped


def test_senders_all_is_refused_for_ipc_per_request_and_falls_back_when_configured(caplog):
    calls, actor = [], TwoRankActor()
    orch = _orch(actor, calls)
    with pytest.raises(ValueError, match="senders=all streams over tcp or nccl; transport=ipc"):
        orch.sync(_targets(), "ipc", senders="all")
    assert orch._owners("ipc", "all") is None and "streams from global rank 0 only" in caplog.text
    assert orch._owners("tcp", "all") == OWNERS and orch._owners("tcp", "rank0") is None
    assert orch._owners("nccl", "all") == OWNERS and orch._owners("nccl", "rank0") is None
    with pytest.raises(ValueError, match="senders='everyone' must be all or rank0"):
        orch.sync(_targets(), senders="everyone")


def test_every_multi_sender_transport_streams_from_each_rank_and_another_is_refused():
    assert sorted(RANK_ENDS) == sorted(multi_sender_names())
    job = SendJob(
        sync_id="s",
        version=1,
        bucket_bytes=256,
        model_family="",
        checksum_algo="",
        origin="",
        digest="",
        targets={},
        macs={},
        timeout=1.0,
        transport="ipc",
    )
    with pytest.raises(ValueError, match=r"^SendJob.transport='ipc' must be tcp or nccl$"):
        _bus_sender(TwoRankActor(), job, 1, time.monotonic() + 1)


def test_a_quantized_export_streams_from_every_owner_with_each_scale_on_its_weights_owner():
    """fp8-block over senders=all: every rank applies the format to its own tensors (SendJob.export_dtype),
    and the plan gives each `*_scale_inv` its weight's owner."""
    from weightsync.publisher.export_format import FP8_BLOCK

    calls, actor = [], TwoRankActor()
    linear = [TensorMeta(f"model.layers.{i}.mlp.down_proj.weight", (128, 128), torch.float32) for i in range(4)]
    actor.export_metas = lambda: list(linear)
    orch = _orch(actor, calls, export_dtype=FP8_BLOCK)
    owners = orch._owners("tcp", "all")
    metas = orch.export_format.metas(linear)
    assert {m.name for m in metas[:2]} == {linear[0].name, linear[0].name + "_scale_inv"}
    assert owners == [0, 0, 0, 0, 1, 1, 1, 1] and len(owners) == len(metas)
    session, manifest = orch._plan([], "tcp", "all")
    assert manifest.senders == [0, 1] and manifest.quantization is not None
    by_rank = {r: [b.index for b in manifest.buckets_of(r)] for r in (0, 1)}

    def run_senders(job):  # each rank reports the buckets of its weights and their scales
        actor.jobs.append(SendJob.from_args(job))
        return [
            SenderResult(rank=r, buckets=len(ix), checksums=[[i, 100 + i] for i in ix]).__dict__
            for r, ix in by_rank.items()
        ]

    actor.run_senders = run_senders
    rep = orch.sync(_targets(), senders="all")
    assert rep.ok and actor.funnelled == 0, [r.error for r in rep.rollouts]
    assert [j.export_dtype for j in actor.jobs] == ["fp8-block"]
    assert _orch(TwoRankActor(), [])._owners("tcp", "all") == OWNERS  # plain export: owners as they are
    with pytest.raises(ValueError, match="3 owners for 4 tensors"):
        orch.export_format.owners(linear, [0, 0, 1])


def _nccl_orch(actor, calls, answers=None):
    """An orchestrator whose nccl sender plans over the in-process loopback (no GPU); rollouts answer
    PrepareSync as the real ones do (echoing no group id when the sync names one group per sender)."""
    from tests.support.nccl_loopback import LoopbackBus
    from weightsync.bus.nccl.sender import NcclSender

    orch = _orch(actor, calls)
    orch.transports["nccl"] = NcclSender(torch.device("cpu"), LoopbackBus(), 5.0)
    plain = orch.rollouts.call

    def call(entry, method, req):
        if method != "PrepareSync":
            return plain(entry, method, req)
        calls.append((entry.rollout_id, method, req))
        err = (answers or {}).get(entry.rollout_id, "")
        if err:
            return None, err
        resp = rollout_pb2.PrepareSyncResponse()
        n = req.transport.nccl
        resp.transport.nccl.group_id = n.group_id  # "" with sender_groups, as the rollout echoes it
        resp.transport.nccl.device_uuid = f"GPU-{entry.rollout_id}"
        return resp, ""

    orch.rollouts.call = call
    return orch


def test_nccl_multi_sender_plans_one_group_per_sender_reuses_them_and_replans_after_a_failure():
    calls, actor = [], TwoRankActor()
    orch = _nccl_orch(actor, calls)
    rep = orch.sync(_targets(), "nccl", senders="all")
    assert rep.ok and actor.funnelled == 0, rep
    (job,) = actor.jobs
    assert job.transport == "nccl" and job.targets == {} and job.macs == {}
    assert sorted(job.nccl_groups) == ["0", "1"]
    g0, g1 = job.nccl_groups["0"], job.nccl_groups["1"]
    assert g0["new_group"] and g1["new_group"] and g0["group_id"] != g1["group_id"]
    assert g0["unique_id"] != g1["unique_id"] and len(bytes.fromhex(g0["unique_id"])) == 128
    assert g0["world_size"] == g1["world_size"] == 3  # the sender + both rollouts
    # every rollout was told both groups, at the same rank in each, and no single group
    preps = {rid: req.transport.nccl for rid, m, req in calls if m == "PrepareSync"}
    for rid, rank in (("a", 1), ("b", 2)):
        n = preps[rid]
        assert n.rank_offset == rank and n.world_size == 3 and n.unique_id == b"" and n.group_id == ""
        assert [(g.sender, g.group_id, g.new_group) for g in n.sender_groups] == [
            (0, g0["group_id"], True),
            (1, g1["group_id"], True),
        ]
        assert bytes(n.sender_groups[1].unique_id).hex() == g1["unique_id"]
    assert orch.transports["nccl"].cache.builds == 1

    # the next sync reuses both groups
    calls.clear()
    assert orch.sync(_targets(), "nccl", senders="all").ok
    again = actor.jobs[-1].nccl_groups
    assert [again[k]["group_id"] for k in ("0", "1")] == [g0["group_id"], g1["group_id"]]
    assert not again["0"]["new_group"] and not again["1"]["new_group"]
    assert not any(g.new_group for _, m, r in calls if m == "PrepareSync" for g in r.transport.nccl.sender_groups)

    # a sender that fails fails every rollout, and the groups are planned anew for the next sync
    actor.rank1 = {"error": "rank 1: NCCL broadcast failed: peer gone", "checksums": []}
    bad = orch.sync(_targets(), "nccl", senders="all")
    assert not bad.ok and all("NCCL broadcast failed" in r.error for r in bad.rollouts)
    actor.rank1 = {}
    assert orch.sync(_targets(), "nccl", senders="all").ok
    fresh = actor.jobs[-1].nccl_groups
    assert fresh["0"]["new_group"] and fresh["1"]["new_group"]
    assert fresh["0"]["group_id"] not in (g0["group_id"], g1["group_id"])

    # back to the funnel: one group of rank 0 (the per-sender plans are dropped)
    calls.clear()
    orch.transports["nccl"].begin = _fake_open(orch.transports["nccl"].begin)
    assert orch.sync(_targets(), "nccl", senders="rank0").ok
    n = [r.transport.nccl for _, m, r in calls if m == "PrepareSync"][0]
    assert not n.sender_groups and n.new_group and len(n.unique_id) == 128


def test_nccl_multi_sender_a_rollout_that_cannot_prepare_is_left_out_of_new_groups():
    calls, actor = [], TwoRankActor()
    orch = _nccl_orch(actor, calls, answers={"b": "UNAVAILABLE: connection refused"})
    rep = orch.sync(_targets(), "nccl", senders="all")
    ok = {r.rollout_id: r for r in rep.rollouts}
    assert ok["a"].ok and not ok["b"].ok, rep
    job = actor.jobs[-1]  # the retry: groups of the sender and "a" alone
    assert all(g["world_size"] == 2 and g["new_group"] for g in job.nccl_groups.values())


def test_nccl_multi_sender_funnels_when_a_rollout_sits_on_a_sending_ranks_gpu(caplog):
    """NCCL takes one rank per GPU in a group: rollout b on rank 1's GPU cannot join rank 1's group.
    The sync is retried through rank 0 at once, and later syncs to b go straight to the funnel."""
    calls, actor = [], TwoRankActor()
    actor.rank_gpus = ["GPU-t0", "GPU-b"]
    orch = _nccl_orch(actor, calls)
    orch.transports["nccl"].begin = _fake_open(orch.transports["nccl"].begin)
    rep = orch.sync(_targets(), "nccl", senders="all")
    assert rep.ok and all(r.ok for r in rep.rollouts), rep
    assert actor.jobs == [] and actor.funnelled == 1 and [s.rank for s in rep.senders] == [0]
    first, retry = [r.transport.nccl for _, m, r in calls if m == "PrepareSync" and _ == "b"]
    assert len(first.sender_groups) == 2 and not retry.sender_groups and retry.new_group
    assert "receives on the GPU of trainer rank 1" in caplog.text
    assert orch.metrics.failures.labels("trainer", "prepare_failed")._value.get() == 0
    calls.clear()
    assert orch.sync(_targets(), "nccl", senders="all").ok
    assert [len(r.transport.nccl.sender_groups) for _, m, r in calls if m == "PrepareSync"] == [0, 0]
    # b rescheduled (a new address) on another GPU: multi-sender again, no funnel
    calls.clear()
    actor.rank_gpus = ["GPU-t0", "GPU-t1"]
    assert orch.sync([RolloutEntry("a", "a:1"), RolloutEntry("b", "b:2")], "nccl", senders="all").ok
    assert [len(r.transport.nccl.sender_groups) for _, m, r in calls if m == "PrepareSync"] == [2, 2]
    assert actor.funnelled == 2 and len(actor.jobs) == 1  # the two syncs to b on rank 1's GPU only
