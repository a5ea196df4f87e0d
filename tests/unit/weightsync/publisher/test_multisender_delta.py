"""Delta syncs with several senders: every rank diffs and keeps the buckets it owns, rank 0 keeps the
base's name. Two sender ranks (threads with the per-rank stand-in of test_multisender.py) stream to
real rollout receivers that keep their delta base (TcpReceiver + SyncTransaction + built-in engine);
rank 0's side is the DeltaBase the orchestrator runs (offer, accepted targets, the ranks' reports).
Checked: the first sync is full, a 2 % change goes as small deltas and is bit-exact; a rank that
lost its part sends its buckets dense (still exact) and deltas resume; a base rank 0 dropped makes
every rank start afresh."""

from __future__ import annotations

from dataclasses import asdict

import torch

from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.sync.transaction import SyncTransaction
from tests.unit.weightsync.publisher.test_multisender import TOKEN, RankActor, _model, _run
from weightsync.bus.copy.checksum import ALGO
from weightsync.bus.layout import ManifestCache
from weightsync.bus.plan import TensorMeta
from weightsync.bus.tcp.receiver import TcpReceiver
from weightsync.models import resolve_model
from weightsync.publisher.delta_sync import DeltaBase
from weightsync.publisher.multisender import SendJob, merge


class Fleet:
    def __init__(self):
        _, self.state, self.owners = _model()
        self.metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in self.state.items()]
        self.cache, self.base = ManifestCache(), DeltaBase("delta", origin="o")
        self.actors = [RankActor(r, self.state, self.owners) for r in (0, 1)]
        self.rollouts = {}
        for rid in ("a", "b"):
            tx = SyncTransaction(BuiltinEngine.from_config(resolve_model("tiny-qwen2")[0], seed=2), "staged")
            rx = TcpReceiver("127.0.0.1:0", tx, TOKEN, delta_base=tx.delta_base)
            rx.start()
            self.rollouts[rid] = (tx, rx)

    def sync(self, version: int):
        """One sync as the orchestrator runs it: (rollout id -> encoding, rollout id -> wire bytes, manifest)."""
        m = self.cache.manifest(
            self.metas,
            version=version,
            sync_id=f"v{version}",
            bucket_bytes=16 << 10,
            checksum_algo=ALGO,
            origin="o",
            owners=self.owners,
        )
        assert len(m.senders) == 2
        stream = self.base.begin(m, "tcp")
        for rid, (tx, _) in self.rollouts.items():
            served = (tx.version, tx.origin, False)
            tx.prepare(m, timeout=30)
            if not tx.delta_base.prepared(m, stream.offer, *served):
                stream.accepted.add(rid)
        job = SendJob.make(m, {rid: f"127.0.0.1:{rx.port}" for rid, (_, rx) in self.rollouts.items()}, TOKEN, 30)
        job.delta = asdict(stream.rank_job())
        out = merge(m, _run(self.actors, job))
        assert out.error == "" and out.failures == {}, (out.error, out.failures)
        stream.senders_kept(out.senders)
        stream.finish(True)
        wire = {rid: sum(s.wire_bytes.get(rid, 0) for s in out.senders) for rid in self.rollouts}
        for rid, (tx, _) in self.rollouts.items():
            assert tx.commit(m.sync_id, version, dict(enumerate(out.checksums)))[0] == version, rid
            for name, t in self.state.items():
                assert torch.equal(tx.engine._target(name), t), (rid, name)  # bit-exact
        enc = {rid: "delta" if rid in stream.accepted else "full" for rid in self.rollouts}
        return enc, wire, m

    def change(self, seed: int, fraction: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.state.values():
            mask = torch.rand(t.shape, generator=g) < fraction
            t[mask] = t[mask] * 1.5 + 0.01

    def close(self):
        for tx, rx in self.rollouts.values():
            tx.abort("", "test over")
            rx.stop()


def test_every_rank_diffs_its_own_buckets_and_the_result_is_exact():
    f = Fleet()
    try:
        enc, wire, m = f.sync(1)
        assert enc == {"a": "full", "b": "full"} and all(w >= m.total_bytes for w in wire.values())
        assert all(
            a.rank_sync_state().delta_part.base.held_bytes() == sum(b.nbytes for b in m.buckets_of(a.rank))
            for a in f.actors
        )
        f.change(seed=1)
        enc, wire, m = f.sync(2)
        assert enc == {"a": "delta", "b": "delta"}
        assert all(w <= 0.15 * m.total_bytes for w in wire.values()), (wire, m.total_bytes)
        # nothing changed: the ranks' frames are headers only, and the base keeps its earlier name too
        enc, wire, m = f.sync(3)
        assert enc == {"a": "delta", "b": "delta"} and all(w < 2048 for w in wire.values()), wire
        assert f.base.streams == ("v2", "v3")

        # rank 1 lost its part (restarted): its buckets go dense, rank 0's as deltas, still exact
        f.actors[1].rank_sync_state().delta_part.drop()
        f.change(seed=2)
        enc, wire, m = f.sync(4)
        dense_1 = sum(b.nbytes for b in m.buckets_of(1))
        assert enc == {"a": "delta", "b": "delta"}
        assert all(dense_1 <= w < dense_1 + 0.15 * m.total_bytes for w in wire.values()), (wire, dense_1)
        f.change(seed=3)
        enc, wire, m = f.sync(5)
        assert all(w <= 0.15 * m.total_bytes for w in wire.values()), wire  # rank 1 holds its part again

        # rank 0 dropped the base (a rollout sent in full failed its commit): every rank starts afresh
        f.base.drop()
        f.change(seed=4)
        enc, wire, m = f.sync(6)
        assert enc == {"a": "full", "b": "full"} and all(w >= m.total_bytes for w in wire.values())
        f.change(seed=5)
        enc, wire, m = f.sync(7)
        assert enc == {"a": "delta", "b": "delta"} and all(w <= 0.15 * m.total_bytes for w in wire.values())
    finally:
        f.close()
