"""weightsync.publisher.multisender without torchrun: two sender ranks (threads with a stand-in for the
megatron actor's per-rank export) stream their own buckets to real rollout receivers (TcpReceiver
+ SyncTransaction + built-in engine); rank 0 merges their reports. The torchrun version of the
same path runs in tests/e2e/test_multisender_e2e.py."""

import threading
from dataclasses import replace

import torch

from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.sync.transaction import SyncTransaction
from weightsync.bus.copy.checksum import ALGO
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.bus.tcp.receiver import TcpReceiver
from weightsync.models import resolve_model
from weightsync.publisher.multisender import SenderResult, SendJob, merge, run_sender
from weightsync.publisher.source import WeightSource
from weightsync.v1 import rollout_pb2

IDS = [3, 1, 4, 1, 5, 9]
TOKEN = "s3cret"


class RankActor(WeightSource):
    """One trainer rank's view: the full metadata and owners, and only its own tensors."""

    def __init__(self, rank, state, owners, die_after=None):
        self.rank, self.state, self.owners, self.die_after = rank, state, owners, die_after

    def export_metas(self):
        return [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in self.state.items()]

    def export_owners(self):
        return list(self.owners)

    def export_own_tensors(self, stats=None):
        for i, ((n, t), o) in enumerate(zip(self.state.items(), self.owners)):
            if o == self.rank:
                if self.die_after is not None and i >= self.die_after:
                    raise RuntimeError(f"rank {self.rank}: gather failed")
                yield n, t


def _model():
    """The source engine, its tensors, and their owners: the first half rank 0's, the rest rank 1's."""
    src = BuiltinEngine.from_config(resolve_model("tiny-qwen2")[0], seed=1)
    state = {n: p.detach().clone() for n, p in src._params.items()}
    half = len(state) // 2
    return src, state, [0] * half + [1] * (len(state) - half)


def _rollouts(m):
    """Two staged rollouts (built-in engine, TCP receiver) with `m` prepared."""
    out = []
    for _ in range(2):
        tx = SyncTransaction(BuiltinEngine.from_config(resolve_model("tiny-qwen2")[0], seed=2), "staged")
        rx = TcpReceiver("127.0.0.1:0", tx, TOKEN)
        rx.start()
        tx.prepare(m, timeout=30)
        out.append((tx, rx))
    return out


def _setup(tmp_bucket=16 << 10):
    src, state, owners = _model()
    m = make_manifest(
        [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in state.items()],
        version=7,
        sync_id="v7-test",
        bucket_bytes=tmp_bucket,
        checksum_algo=ALGO,
        owners=owners,
    )
    rollouts = _rollouts(m)
    return src, state, owners, m, rollouts


def _run(actors, job):
    results = [None] * len(actors)

    def go(i):
        results[i] = run_sender(actors[i], SendJob.from_args(job.to_args()))  # through JSON, as the channel does

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(actors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_two_senders_stream_their_own_buckets_and_both_rollouts_commit_exactly():
    src, state, owners, m, rollouts = _setup()
    try:
        job = SendJob.make(m, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        assert TOKEN not in str(job.to_args())  # the other ranks get MACs, never the token
        out = merge(m, _run([RankActor(0, state, owners), RankActor(1, state, owners)], job))
        assert out.error == "" and out.failures == {}
        assert [s.groups for s in out.senders] == [[], []]  # tracing off: no bucket groups recorded
        assert [(s.rank, s.buckets, s.bytes) for s in out.senders] == [
            (r, len(m.buckets_of(r)), sum(b.tensor_bytes for b in m.buckets_of(r))) for r in (0, 1)
        ]
        # each sender's pack buffers: at most two of its own buckets
        for s in out.senders:
            assert 0 < s.peak_buffer_bytes <= 2 * max(b.nbytes for b in m.buckets_of(s.rank)), s
        for tx, _ in rollouts:
            version, _, _ = tx.commit(m.sync_id, 7, dict(enumerate(out.checksums)))
            assert version == 7
            (_, logits), _ = tx.serve(lambda e: e.score(IDS, 1), timeout=5)
            assert torch.equal(logits, src.score(IDS, 1)[1])
    finally:
        for tx, rx in rollouts:
            tx.abort("v7-test", "test over")
            rx.stop()


def test_a_sender_failing_mid_export_fails_the_stream_and_every_rollout_aborts():
    src, state, owners, m, rollouts = _setup(tmp_bucket=4 << 10)
    try:
        job = SendJob.make(m, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        results = _run([RankActor(0, state, owners), RankActor(1, state, owners, die_after=len(state) - 2)], job)
        out = merge(m, results)
        assert "rank 1: gather failed" in out.error
        for tx, _ in rollouts:
            for _ in range(100):
                if tx.pending_sync_id == "":
                    break
                threading.Event().wait(0.05)
            # the stream of rank 1 ended early: each rollout aborted and serves what it had
            assert tx.pending_sync_id == "" and tx.state == rollout_pb2.SERVING and tx.version == 0
    finally:
        for tx, rx in rollouts:
            tx.abort("v7-test", "test over")
            rx.stop()


def _fp8_sync(state, owners):
    """Rollouts prepared for the fp8-block manifest of `state` (each scale on its weight's owner),
    and the outcome of two sender ranks streaming it to them."""
    from weightsync.publisher.export_format import FP8_BLOCK, export_format

    fmt = export_format(FP8_BLOCK)
    plain = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    m = make_manifest(
        fmt.metas(plain),
        version=7,
        sync_id="v7-fp8",
        bucket_bytes=16 << 10,
        checksum_algo=ALGO,
        owners=fmt.owners(plain, owners),
        quantization=fmt.quantization,
    )
    rollouts = _rollouts(m)
    try:
        job = SendJob.make(
            m,
            {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)},
            TOKEN,
            30,
            export_dtype="fp8-block",
        )
        out = merge(m, _run([RankActor(0, state, owners), RankActor(1, state, owners)], job))
    except BaseException:
        _stop(rollouts, m.sync_id)
        raise
    return fmt, m, rollouts, out


def _stop(rollouts, sync_id):
    for tx, rx in rollouts:
        tx.abort(sync_id, "test over")
        rx.stop()


def test_fp8_every_owner_quantizes_and_streams_its_own_weights_and_scales():
    """fp8-block with two senders: each rank quantizes the tensors it assembles (a weight's scale
    goes with it), and the rollouts end with exactly what one stream of the whole model gives."""
    from weightsync.formats.fp8.receive import Dequantizer

    _, state, owners = _model()
    fmt, m, rollouts, out = _fp8_sync(state, owners)
    try:
        scales = [s.meta.name for b in m.buckets for s in b.slots if s.meta.name.endswith("_scale_inv")]
        assert scales and set(m.senders) == {0, 1}
        for b in m.buckets:  # a scale rides with its weight's owner
            for s in b.slots:
                if s.meta.name.endswith("_scale_inv"):
                    weight = s.meta.name.removesuffix("_scale_inv")
                    assert owners[list(state).index(weight)] == b.sender, s.meta.name
        assert out.error == "" and out.failures == {}
        dtypes = {n: p.dtype for n, p in rollouts[0][0].engine._params.items()}
        want = dict(Dequantizer(dtypes)(fmt.tensors(state.items())))  # the whole model as one stream
        for tx, _ in rollouts:
            assert tx.commit(m.sync_id, 7, dict(enumerate(out.checksums)))[0] == 7
            for name, t in want.items():
                assert torch.equal(tx.engine._target(name), t.to(dtypes[name])), name
    finally:
        _stop(rollouts, m.sync_id)


def test_fp8_a_rank_with_diverged_weights_fails_the_sync_on_every_rollout():
    _, state, owners = _model()
    bad = next(n for n, o in zip(state, owners) if o == 1 and n.endswith("proj.weight"))
    state = dict(state)
    state[bad] = state[bad].clone()
    state[bad][0, 0] = float("inf")
    fmt, m, rollouts, out = _fp8_sync(state, owners)
    try:
        # The check runs at the end of rank 1's stream, so its bytes may all have arrived: the
        # report is what fails the sync (rank 0 then aborts every target instead of committing).
        assert f"rank 1: tensor {bad}: block [0, 0] holds inf or nan" in out.error, out.error
        assert [s.rank for s in out.senders if s.error] == [1]
        for tx, _ in rollouts:
            assert tx.version == 0 and tx.pending_sync_id == "v7-fp8"  # nothing committed; rank 0 aborts
            tx.abort("v7-fp8", "sender rank 1 failed")
            assert tx.state == rollout_pb2.SERVING and tx.version == 0
    finally:
        _stop(rollouts, m.sync_id)


def test_a_rank_with_another_layout_refuses_to_stream():
    src, state, owners, m, rollouts = _setup()
    try:
        job = SendJob.make(m, {"r0": f"127.0.0.1:{rollouts[0][1].port}"}, TOKEN, 30)
        res = run_sender(RankActor(1, state, [1] * len(owners)), job)
        assert "different bucket layout" in res.error and res.buckets == 0
    finally:
        for tx, rx in rollouts:
            tx.abort("v7-test", "test over")
            rx.stop()


def test_merge_names_the_dropped_rollouts_and_missing_buckets():
    m = make_manifest(
        [TensorMeta(f"t{i}", (64,), torch.float32) for i in range(4)],
        version=1,
        sync_id="s",
        bucket_bytes=256,
        owners=[0, 0, 1, 1],
    )
    ok0 = SenderResult(rank=0, buckets=2, checksums=[[0, 11], [1, 12]])
    ok1 = SenderResult(rank=1, buckets=2, checksums=[[2, 21], [3, 22]], failures={"rB": "TCP bus send failed"})
    out = merge(m, [ok0, ok1, SenderResult(rank=2)])
    assert out.error == "" and out.checksums == [11, 12, 21, 22]
    assert out.failures == {"rB": "sender rank 1: TCP bus send failed"}
    assert [s.rank for s in out.senders] == [0, 1]  # rank 2 owns nothing: not a sender
    short = merge(m, [ok0, SenderResult(rank=1, checksums=[[2, 21]])])
    assert "no sender streamed bucket(s) [3]" in short.error


class FlatRankActor(RankActor):
    """A rank whose actor writes its own buckets (as MegatronActor.own_flat_buckets does): packed here
    from its tensors, once per layout digest; its export must then never run. `refuse`: None (pack)."""

    own_flat = True

    def __init__(self, rank, state, owners, refuse=False, device="cpu"):
        super().__init__(rank, state, owners)
        self.refuse, self.calls, self.flats, self.device = refuse, [], None, device

    def parameters(self):  # where its buckets would live (multisender.export_device)
        return [torch.empty(1, device=self.device)]

    def own_flat_buckets(self, manifest):
        from weightsync.bus.pack import pack_bucket

        assert manifest.layout_digest and all(b.sender == self.rank for b in manifest.buckets), manifest
        self.calls.append(manifest.layout_digest)
        if self.refuse:
            return None
        if self.flats is None:
            own = iter((n, t) for (n, t), o in zip(self.state.items(), self.owners) if o == self.rank)
            self.flats = []
            for plan in manifest.buckets:
                buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
                pack_bucket(plan, (next(own) for _ in plan.slots), buf)
                self.flats.append(buf)
        return self.flats

    def export_own_tensors(self, stats=None):
        if self.refuse:
            yield from super().export_own_tensors(stats)
            return
        raise AssertionError(f"rank {self.rank} exported although it sent its buckets in place")


def test_a_rank_with_flat_buckets_streams_them_in_place_beside_one_that_packs():
    """Rank 0 sends its buckets from its own storage (no export, no pack buffers; flat_buckets says
    so), rank 1's actor declines and packs: the rollouts commit exactly the model either way; a second
    sync of the same layout asks the actor under the same layout digest (its plan is reused)."""
    src, state, owners, m, rollouts = _setup()
    try:
        job = SendJob.make(m, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        flat, packs = FlatRankActor(0, state, owners), FlatRankActor(1, state, owners, refuse=True)
        out = merge(m, _run([flat, packs], job))
        assert out.error == "" and out.failures == {}, out.error
        s = {r.rank: r for r in out.senders}
        assert (s[0].flat_buckets, s[0].peak_buffer_bytes) == (len(m.buckets_of(0)), 0), s[0]
        assert s[1].flat_buckets == 0 and s[1].peak_buffer_bytes > 0, s[1]
        assert len(flat.calls) == 1 and len(packs.calls) == 1
        for tx, _ in rollouts:
            assert tx.commit(m.sync_id, 7, dict(enumerate(out.checksums)))[0] == 7
            (_, logits), _ = tx.serve(lambda e: e.score(IDS, 1), timeout=5)
            assert torch.equal(logits, src.score(IDS, 1)[1])
        again = m.sync_id.replace("v7", "v8")
        m8 = replace(m, sync_id=again, version=8)
        for tx, _ in rollouts:
            tx.prepare(m8, timeout=30)
        job8 = SendJob.make(m8, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        assert merge(m8, _run([flat, packs], job8)).error == ""
        assert flat.calls[0] == flat.calls[1]  # a layout digest, not the sync's own digest
        for tx, _ in rollouts:
            tx.abort(again, "test over")
    finally:
        _stop(rollouts, m.sync_id)


def test_a_flat_rank_keeps_its_in_place_buckets_as_its_part_of_a_delta_base():
    """A delta sync's part (rank_delta_stream) diffs and keeps in-place buckets as it does packed
    ones: the rank's base is a copy of its buckets (not the parameters' storage, which training
    changes), and its checksums are those of the buckets."""
    src, state, owners, m, rollouts = _setup()
    try:
        job = SendJob.make(m, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        job.delta = {"base": "", "accepted": [], "layout_digest": "L"}
        flat = FlatRankActor(0, state, owners)
        out = merge(m, _run([flat, RankActor(1, state, owners)], job))
        assert out.error == "" and out.senders[0].flat_buckets == len(m.buckets_of(0)) and out.senders[0].kept
        base = flat.rank_sync_state().delta_part.base._bufs
        mine = m.buckets_of(0)
        assert sorted(base) == [b.index for b in mine]
        for b, f in zip(mine, flat.flats):
            assert torch.equal(base[b.index], f[: b.nbytes]) and base[b.index].data_ptr() != f.data_ptr()
        for tx, _ in rollouts:
            assert tx.commit(m.sync_id, 7, dict(enumerate(out.checksums)))[0] == 7
            (_, logits), _ = tx.serve(lambda e: e.score(IDS, 1), timeout=5)
            assert torch.equal(logits, src.score(IDS, 1)[1])
    finally:
        _stop(rollouts, m.sync_id)


def test_a_rank_whose_buckets_live_elsewhere_than_its_delta_base_packs():
    """A GPU rank streaming over TCP packs in host memory, where its delta part keeps its copy of the
    base: in-place buckets on its GPU would move that copy to GPU memory, so it packs as before (here
    the 'GPU' is the meta device: the actor is not even asked)."""
    src, state, owners, m, rollouts = _setup()
    try:
        job = SendJob.make(m, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        job.delta = {"base": "", "accepted": [], "layout_digest": "L"}
        elsewhere = FlatRankActor(0, state, owners, refuse=False, device="meta")
        elsewhere.export_own_tensors = lambda stats=None: RankActor.export_own_tensors(elsewhere, stats)
        out = merge(m, _run([elsewhere, RankActor(1, state, owners)], job))
        assert out.error == "" and out.senders[0].flat_buckets == 0 and elsewhere.calls == [], out.senders
        assert out.senders[0].peak_buffer_bytes > 0 and out.senders[0].kept
        for tx, _ in rollouts:
            assert tx.commit(m.sync_id, 7, dict(enumerate(out.checksums)))[0] == 7
            (_, logits), _ = tx.serve(lambda e: e.score(IDS, 1), timeout=5)
            assert torch.equal(logits, src.score(IDS, 1)[1])
    finally:
        _stop(rollouts, m.sync_id)


class BrokenExchangeActor(FlatRankActor):
    """An actor whose flat path fails after its collective began (megatron's TP exchange): the other
    ranks of its group went flat, so it must neither pack nor run its export (whose gathers would find
    no partner); a rank owning no bucket (`owners` all another's) is asked too, and fails the same way."""

    def own_flat_buckets(self, manifest):
        from weightsync.bus.errors import TransportError

        self.calls.append(manifest.layout_digest)
        raise TransportError(f"rank {self.rank}: the TP group's flat-export exchange failed: peer gone")


def test_a_flat_exchange_that_fails_fails_the_rank_without_running_its_export():
    src, state, owners, m, rollouts = _setup()
    try:
        job = SendJob.make(m, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        owner = BrokenExchangeActor(0, state, owners)
        # a third rank with no bucket of its own (a TP rank that only sends its shards): asked as well
        idle = BrokenExchangeActor(2, state, owners)
        results = _run([owner, FlatRankActor(1, state, owners), idle], job)
        assert all(r is not None for r in results), results  # an export drained would have raised
        out = merge(m, results)
        assert "rank 0: the TP group's flat-export exchange failed" in out.error, out.error
        assert "rank 2: the TP group's flat-export exchange failed" in out.error, out.error
        assert len(owner.calls) == 1 and len(idle.calls) == 1
        # (rank 1's stream may fail too: the rollouts drop the sync when rank 0's connection dies)
        assert results[0].flat_buckets == 0 and results[0].buckets == 0, results[0]
    finally:
        _stop(rollouts, m.sync_id)


def test_each_sender_reports_its_bucket_groups_only_when_the_job_traces_them():
    src, state, owners, m, rollouts = _setup()
    try:
        job = SendJob.make(m, {f"r{i}": f"127.0.0.1:{rx.port}" for i, (_, rx) in enumerate(rollouts)}, TOKEN, 30)
        job.trace_groups = True  # rank 0 traces the sync
        for s in _run([RankActor(0, state, owners), RankActor(1, state, owners)], job):
            assert not s.error, s
            mine = m.buckets_of(s.rank)
            covered = [i for first, last, *_ in s.groups for i in range(first, last + 1)]
            # consecutive runs of its own buckets (their manifest indices), in order, bytes adding up
            assert [i for i in covered if i in {b.index for b in mine}] == [b.index for b in mine], s.groups
            assert sum(g[2] for g in s.groups) == len(mine) and sum(g[3] for g in s.groups) == s.bytes > 0
    finally:
        for tx, rx in rollouts:
            tx.abort("v7-test", "test over")
            rx.stop()
