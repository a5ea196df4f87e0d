"""rollout-svc writes NCCL and TCP buckets into every SGLang TP rank's shards itself
(rollout_svc/engine/sglang_shards.py).

Two TP ranks, each a model loading as SGLang's parallel layers do (fused qkv and gate_up: the rank's rows of each
checkpoint tensor; a row-parallel weight: its columns; a replicated norm), behind a stand-in for SGLang's Engine
that runs our loader once per rank (as each TP worker does). Buckets reach the sync transaction as the TCP and
NCCL receivers hand them (in-place apply); the first sync learns through SGLang's loader, each rank then exports
a table of its pieces, rollout-svc maps both (CUDA IPC stood in for on the CPU) and writes every later bucket into
both ranks with no SGLang call. tests/sglang_exec/tp_checks.py runs the same through SGLang's own parallel layers.
"""

from __future__ import annotations

import pytest
import torch

from rollout_svc.engine import sglang_loader as sl
from rollout_svc.sync.transaction import SyncTransaction
from tests.support.fake_sglang import FakeSglang, adapter_on, scripted
from tests.support.packed import packed_sync
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.errors import SyncError
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.v1 import rollout_pb2

H, TP = 8, 2
SHAPES = {
    "q": (H, H),
    "k": (H // 2, H),
    "v": (H // 2, H),
    "gate": (2 * H, H),
    "up": (2 * H, H),
    "down": (H, 2 * H),
    "norm": (H,),
}


class RankModel(torch.nn.Module):
    """TP rank `rank`'s parameters, loaded as SGLang's QKVParallelLinear / MergedColumnParallelLinear /
    RowParallelLinear / replicated norm load theirs."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

        def param(*shape):
            return torch.nn.Parameter(torch.full(shape, float("nan"), dtype=torch.bfloat16), requires_grad=False)

        self.qkv = param((H + H) // TP, H)  # q: H rows, k and v: H/2 each; a rank keeps 1/TP of each
        self.gate_up = param(4 * H // TP, H)
        self.down = param(H, 2 * H // TP)
        self.norm = param(H)

    def load_weights(self, named):
        for name, w in named:
            if name in ("q", "k", "v"):
                n, at = w.shape[0] // TP, {"q": 0, "k": H // TP, "v": H // TP + H // (2 * TP)}[name]
                self.qkv.data.narrow(0, at, n).copy_(w.narrow(0, self.rank * n, n))
            elif name in ("gate", "up"):
                n = w.shape[0] // TP
                at = 0 if name == "gate" else n
                self.gate_up.data.narrow(0, at, n).copy_(w.narrow(0, self.rank * n, n))
            elif name == "down":
                n = w.shape[1] // TP
                self.down.data.copy_(w.narrow(1, self.rank * n, n))
            else:
                self.norm.data.copy_(w)


class TpSglang(FakeSglang):
    """SGLang's Engine whose TP workers (one model each) run our loader on every update_weights_from_tensor."""

    def __init__(self, models, monkeypatch):
        super().__init__(scripted([1], [-0.1]))
        self.models, self.loads, self._mp = models, [], monkeypatch

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == sl.LOADER and not flush_cache
        self.loads.append("export" if named_tensors[0][0].startswith(sl.EXPORT) else "bucket")
        for rank, model in enumerate(self.models):
            self._mp.setattr(sl, "_tp_rank", lambda rank=rank: rank)
            sl.load(model, named_tensors)
        return True, "Succeeded"


pytestmark = pytest.mark.usefixtures("io_struct")  # conftest.py


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*shape, generator=g).to(torch.bfloat16) for n, shape in SHAPES.items()}


def _reference(state) -> list[RankModel]:
    """Each rank's parameters as its own loader leaves them from the whole tensors."""
    models = [RankModel(r) for r in range(TP)]
    for m in models:
        m.load_weights(list(state.items()))
    return models


@pytest.fixture
def rollout(ipc, monkeypatch):
    models = [RankModel(r) for r in range(TP)]
    sgl = TpSglang(models, monkeypatch)
    eng = adapter_on(sgl, tp_size=TP)
    eng.tp_size = TP
    eng._direct_rows, eng.direct_cpu = [torch.zeros(16, sl.RESULT_WORDS, dtype=torch.int64) for _ in range(TP)], True
    eng.open_allocation = ipc.open
    eng.load_bucket = lambda plan, buf: eng.load_bucket_summed(plan, buf)  # CPU buffers stand in for CUDA ones
    eng._metas = {n: TensorMeta(n, shape, torch.bfloat16) for n, shape in SHAPES.items()}
    return models, sgl, eng, SyncTransaction(eng, "inplace")


def _sync(tx, version: int, upto: int | None = None, corrupt: int | None = None):
    """Sync `_state(version)` in several buckets; `upto`: only the buckets before it arrive, then the trainer
    aborts; `corrupt`: that bucket's sender checksum is off by one bit."""
    state = _state(version)
    m, bufs = packed_sync(state, version=version, sync_id=f"s{version}", bucket_bytes=384)
    assert len(bufs) >= 4, len(bufs)
    sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
    tx.prepare(m, timeout=30)
    for i, buf in enumerate(bufs[:upto]):
        tx.consume_bucket(m.sync_id, i, buf, sums[i] ^ (i == corrupt))
    if upto is not None:
        tx.abort(m.sync_id, "the trainer gave up")
        return state, bufs
    tx.commit(m.sync_id, version, sums)
    return state, bufs


def _assert_holds(models, state) -> None:
    for mine, want in zip(models, _reference(state)):
        for name, p in want.named_parameters():
            assert torch.equal(getattr(mine, name), p), f"rank {mine.rank} {name}"


def test_after_the_learning_sync_rollout_svc_writes_every_ranks_shards_with_no_sglang_call(rollout, ipc):
    models, sgl, eng, tx = rollout
    state, bufs = _sync(tx, 1)
    _assert_holds(models, state)
    n = len(bufs)
    assert sgl.loads == ["bucket"] * n + ["export"]  # learnt through SGLang's loader, then each rank's table
    assert eng.ipc_destinations is not None and eng._shard_pieces and not eng._mapped_views
    assert not eng._export_dir or not __import__("os").listdir(eng._export_dir), "a rank's table file was left"
    opens = ipc.opens
    for version in (2, 3):
        sgl.events.clear()
        state, bufs = _sync(tx, version)
        _assert_holds(models, state)  # exactly the trainer's tensors, in each rank's fused shards
        assert sgl.loads == ["bucket"] * n + ["export"], "SGLang's loader was called after the first sync"
        assert sgl.events == ["pause", "flush", "continue"], sgl.events
        total = sum(b.numel() for b in bufs)
        per_rank = eng.bytes_per_rank(total)
        # each rank read its shards, the replicated norm and the gaps: about half the bytes, never the whole
        assert all(total // 2 <= got < 0.6 * total for got in per_rank), (per_rank, total)
    assert tx.state == rollout_pb2.SERVING and tx.version == 3 and ipc.opens == opens  # mapped once


def test_the_ranks_tables_are_never_offered_to_the_trainer(rollout):
    _, _, eng, tx = rollout
    _sync(tx, 1)
    metas = [TensorMeta(n, s, torch.bfloat16) for n, s in SHAPES.items()]
    m = make_manifest(metas, version=2, sync_id="s2", bucket_bytes=384, checksum_algo="ws-sum64-v1")
    assert eng._dest_tables and eng.ipc_destinations(m) is None


def test_a_bucket_that_fails_its_check_after_the_write_aborts_the_sync_stale(rollout):
    models, sgl, _, tx = rollout
    _sync(tx, 1)
    loads = len(sgl.loads)
    with pytest.raises(SyncError, match="checksum") as err:
        _sync(tx, 2, corrupt=1)  # checked after its write into both ranks
    assert err.value.code == "DATA_LOSS"
    tx.abort("s2", "bucket 1's checksum")  # (the receiver aborts a sync whose bucket failed)
    assert tx.state == rollout_pb2.STALE and len(sgl.loads) == loads
    _assert_holds(models, _sync(tx, 3)[0])  # the next complete sync heals, still with no SGLang call
    assert tx.state == rollout_pb2.SERVING and len(sgl.loads) == loads


def test_an_abort_after_a_written_bucket_is_stale(rollout):
    models, sgl, _, tx = rollout
    _sync(tx, 1)
    old = _reference(_state(1))
    _sync(tx, 2, upto=1)
    assert tx.state == rollout_pb2.STALE  # bucket 0 (q, k) of version 2 is in both ranks' parameters
    new = _reference(_state(2))
    qk = H // TP + H // (2 * TP)  # a rank's rows of q and k in its fused qkv
    for mine, was, now in zip(models, old, new):
        assert torch.equal(mine.qkv, torch.cat([now.qkv[:qk], was.qkv[qk:]])), mine.rank
        assert torch.equal(mine.gate_up, was.gate_up), mine.rank
    _assert_holds(models, _sync(tx, 3)[0])
    assert tx.state == rollout_pb2.SERVING


def test_a_rank_whose_common_words_differ_fails_the_bucket(rollout, monkeypatch):
    """The ranks' `common` sums must agree: a rank that read other bytes fails the sync, never passes."""
    from rollout_svc.engine import sglang_shards

    _, _, _, tx = rollout
    _sync(tx, 1)
    real, calls = sglang_shards.write_rank, []

    def skewed(*args):
        sums = real(*args)
        calls.append(1)
        if len(calls) % TP == 0:  # the last rank's copy of each bucket
            sums = sums.clone()
            sums[0, 0] += 1
        return sums

    monkeypatch.setattr(sglang_shards, "write_rank", skewed)
    with pytest.raises(SyncError, match="read different bytes") as err:
        _sync(tx, 2)
    assert err.value.code == "DATA_LOSS" and calls


@pytest.mark.parametrize("how", ["a mapping shorter than its entries", "rollout_writes=False"])
def test_without_usable_shard_tables_every_sync_goes_through_sglangs_loader(rollout, ipc, how):
    import dataclasses

    models, sgl, eng, tx = rollout
    if how == "a mapping shorter than its entries":
        eng.open_allocation = lambda h: ipc.open(h)[:8]
    else:
        eng.opts = dataclasses.replace(eng.opts, rollout_writes=False)
    _sync(tx, 1)
    loads = sgl.loads.count("bucket")
    for version in (2, 3):
        state, bufs = _sync(tx, version)
        _assert_holds(models, state)
    assert sgl.loads.count("bucket") == loads + 2 * len(bufs), sgl.loads  # every bucket through the loader
    assert not eng._shard_pieces


def test_a_colocated_ipc_bucket_keeps_the_per_rank_handles_path(rollout):
    """A trainer's IPC buffer mapped here (handles.consuming) is not written by rollout-svc: the ranks open it."""
    from weightsync.bus.ipc.handles import consuming
    from weightsync.v1 import bus_pb2

    _, _, eng, tx = rollout
    _sync(tx, 1)
    m, bufs = packed_sync(_state(2), version=2, sync_id="s2", bucket_bytes=384)
    eng.writing_in_place = True  # (begin_apply)
    assert eng.write_shards(m.buckets[0], bufs[0]) is not None  # a received bucket: written here
    with consuming(bufs[1], bus_pb2.CudaIpcHandle(handle=b"trainer")):
        assert eng.write_shards(m.buckets[1], bufs[1]) is None
    eng.writing_in_place = False
