"""The rollout sync transaction against the real built-in engine (no network)."""

import pytest
import torch

from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.sync.transaction import SyncTransaction
from tests.support.packed import engine_state, packed_sync
from weightsync.bus.copy.checksum import ALGO, bucket_checksum
from weightsync.bus.errors import SyncError
from weightsync.bus.pack import unpack_bucket
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.models import resolve_model
from weightsync.v1 import rollout_pb2

IDS = [3, 1, 4, 1, 5, 9]


def _engine(seed, cls=BuiltinEngine):
    return cls.from_config(resolve_model("tiny-qwen2")[0], seed=seed)


def _buckets(src, version=1, sync_id="s1"):
    return packed_sync(engine_state(src), version=version, sync_id=sync_id)


def _staged_sync_all_received(timeout: float):
    """A staged transaction with sync s1 (seed 1's weights) prepared and every bucket received:
    (tx, the logits it served before, the buckets)."""
    tx = SyncTransaction(_engine(2), "staged")
    before = _logits(tx)
    m, bufs = _buckets(_engine(1))
    tx.prepare(m, timeout=timeout)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, bucket_checksum(buf))
    return tx, before, bufs


def _generation_holding_the_engine(tx):
    """A request that pins the engine until the returned event is set: (event, its thread)."""
    import threading
    import time

    release = threading.Event()
    busy = threading.Thread(target=lambda: tx.serve(lambda e: release.wait(15), timeout=5), daemon=True)
    busy.start()
    deadline = time.monotonic() + 5
    while not tx.engine_lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    return release, busy


def _abort_ends_the_wait(tx, pool, waiting, why: str) -> None:
    """The trainer's abort of s1 is answered within a second and ends `waiting` with `why`."""
    import time

    t0 = time.monotonic()
    pool.submit(tx.abort, "s1", "the trainer gave up").result(timeout=2)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(SyncError, match=f"{why}: the trainer gave up"):
        waiting.result(timeout=2)


def _still_serving_version_0(tx, release, busy, before) -> None:
    assert tx.state == rollout_pb2.SERVING and tx.version == 0 and tx.pending_sync_id == ""
    release.set()
    busy.join(5)
    assert not tx.engine_lock.locked()
    assert torch.equal(_logits(tx), before)


def _logits(tx):
    (_, logits), _ = tx.serve(lambda e: e.score(IDS, 1), timeout=5)
    return logits


@pytest.mark.parametrize("mode", ["staged", "inplace"])
def test_commit_applies_exactly_and_abort_keeps_a_complete_version(mode):
    target, eng = _engine(1), _engine(2)
    tx = SyncTransaction(eng, mode)
    before = _logits(tx)
    m, bufs = _buckets(target)
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, bucket_checksum(buf))
    version, _, _ = tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    assert version == 1 and tx.state == rollout_pb2.SERVING
    assert torch.equal(_logits(tx), target.score(IDS, 1)[1])

    m2, bufs2 = _buckets(_engine(3), version=2, sync_id="s2")
    tx.prepare(m2, timeout=30)
    tx.consume_bucket("s2", 0, bufs2[0], None)
    tx.abort("s2", "test")
    if mode == "staged":  # old version intact and served
        assert tx.state == rollout_pb2.SERVING and tx.version == 1
        assert torch.equal(_logits(tx), target.score(IDS, 1)[1])
    else:  # partly applied: refuse to serve until a complete sync commits
        assert tx.state == rollout_pb2.STALE
        with pytest.raises(SyncError, match="STALE"):
            _logits(tx)
    assert not torch.equal(before, target.score(IDS, 1)[1])


def test_checksum_mismatch_at_commit_is_refused():
    tx = SyncTransaction(_engine(2), "staged")
    m, bufs = _buckets(_engine(1))
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, None)
    with pytest.raises(SyncError, match="checksum"):
        tx.commit("s1", 1, {i: 0 for i in range(len(bufs))})
    assert tx.state == rollout_pb2.SERVING and tx.version == 0


def test_prepared_sync_expires():
    import time

    tx = SyncTransaction(_engine(2), "staged")
    m, _ = _buckets(_engine(1))
    tx.prepare(m, timeout=0.3)
    time.sleep(0.8)
    assert tx.pending_sync_id == "" and tx.state == rollout_pb2.SERVING
    assert "timed out" in tx.last_error
    # a sync that supersedes a prepared one runs on its own deadline, not the one it replaced
    tx.prepare(m, timeout=0.3)
    m2, _ = _buckets(_engine(1), version=2, sync_id="s2")
    tx.prepare(m2, timeout=30)
    time.sleep(0.6)
    assert tx.pending_sync_id == "s2"
    tx.abort("s2", "test over")


class HookedEngine(BuiltinEngine):
    """The built-in engine plus the optional whole-bucket hooks the SGLang adapter implements."""

    calls: list

    def writable_params(self, metas):
        return None  # as the SGLang adapter: its parameters live in SGLang's processes

    def begin_apply(self):
        self.calls.append("begin")

    def load_bucket(self, plan, buf):
        self.calls.append(("bucket", plan.index))
        self.load_weights(unpack_bucket(plan, buf))

    def end_apply(self):
        self.calls.append("end")
        self.flush_cache()


def test_inplace_uses_optional_engine_hooks():
    eng = _engine(2, HookedEngine)
    eng.calls = []
    tx = SyncTransaction(eng, "inplace")
    target = _engine(1)
    m, bufs = _buckets(target)
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, None)
    tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    assert eng.calls == ["begin"] + [("bucket", i) for i in range(len(bufs))] + ["end"]
    assert torch.equal(_logits(tx), target.score(IDS, 1)[1])


def test_staged_commit_waits_for_a_busy_engine_only_until_the_deadline():
    """A generation that holds the engine past the sync's deadline makes the commit fail in time
    (DEADLINE_EXCEEDED), not hang: the staged weights are dropped and the old version keeps serving."""
    import time

    tx, before, bufs = _staged_sync_all_received(timeout=1.0)
    release, busy = _generation_holding_the_engine(tx)
    assert tx.engine_lock.locked()
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="did not become free") as err:
        tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    assert err.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 2.0
    release.set()
    busy.join(5)
    assert tx.state == rollout_pb2.SERVING and tx.version == 0 and tx.pending_sync_id == ""
    assert torch.equal(_logits(tx), before)


@pytest.mark.parametrize(
    "mode,bad,after", [("staged", 1, "SERVING"), ("inplace", 0, "SERVING"), ("inplace", 1, "STALE")]
)
def test_a_corrupted_bucket_is_data_loss_and_only_an_inplace_sync_past_its_first_bucket_turns_stale(mode, bad, after):
    """The copy out of the bus buffer is the checksum pass (weightsync/bus/copy/verified_copy.py): inplace
    mode checks a bucket after writing it into the parameters, except the first one, which is still
    checked before the engine is touched."""
    target, eng = _engine(1), _engine(2)
    tx = SyncTransaction(eng, mode)
    before = _logits(tx)
    m, bufs = _buckets(target)
    assert len(m.buckets) > 2
    sums = [bucket_checksum(b) for b in bufs]
    bufs[bad][5] ^= 0x01  # one flipped bit inside the bucket's first tensor
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets[:bad], bufs):
        tx.consume_bucket("s1", b.index, buf, sums[b.index])
    want = rf"bucket {bad}: checksum 0x[0-9a-f]+ != sender.s 0x[0-9a-f]+ \(corrupted in transit\)"
    with pytest.raises(SyncError, match=want) as err:
        tx.consume_bucket("s1", bad, bufs[bad], sums[bad])
    assert err.value.code == "DATA_LOSS"
    tx.abort("s1", "checksum")
    assert tx.state == getattr(rollout_pb2, after) and tx.version == 0
    if after == "SERVING":
        assert torch.equal(_logits(tx), before)


def test_inplace_writes_the_parameters_directly_and_the_result_equals_the_target():
    target, eng = _engine(1), _engine(2)
    tx = SyncTransaction(eng, "inplace")
    m, bufs = _buckets(target)
    calls = []
    load = eng.load_weights
    eng.load_weights = lambda named: calls.append(1) or load(named)
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, bucket_checksum(buf))
    tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    # every bucket copied in, the first too (checked before the engine is touched, then copied the
    # same way): the engine's per-tensor loader is never called
    assert calls == []
    for name, p in target._params.items():
        assert torch.equal(eng._params[name], p), name


@pytest.mark.parametrize("mode,after", [("staged", "SERVING"), ("inplace", "STALE")])
def test_deferred_checks_are_read_at_commit_where_a_corrupted_bucket_aborts_as_at_receipt(mode, after):
    target, eng = _engine(1), _engine(2)
    tx = SyncTransaction(eng, mode)
    before = _logits(tx)
    m, bufs = _buckets(target)
    sums = [bucket_checksum(b) for b in bufs]
    # a clean sync with every check deferred commits exactly
    tx.prepare(m, timeout=30)
    deferred = [
        tx.consume_bucket("s1", b.index, buf, sums[b.index], defer_check=True) for b, buf in zip(m.buckets, bufs)
    ]
    # every copy is left queued, an inplace sync's first bucket's too (its bytes were checked before
    # the engine was touched; its copy's sum is read at commit like the others')
    assert deferred == [True] * len(bufs)
    version, _, _ = tx.commit("s1", 1, dict(enumerate(sums)))
    assert version == 1 and torch.equal(_logits(tx), target.score(IDS, 1)[1])
    # the same bytes with one bit flipped in bucket 1: accepted at receipt, refused at commit
    m2, bufs2 = _buckets(_engine(3), version=2, sync_id="s2")
    sums2 = [bucket_checksum(b) for b in bufs2]
    bufs2[1][5] ^= 0x01
    tx.prepare(m2, timeout=30)
    for b, buf in zip(m2.buckets, bufs2):
        tx.consume_bucket("s2", b.index, buf, sums2[b.index], defer_check=True)
    with pytest.raises(SyncError, match=r"bucket 1: checksum 0x[0-9a-f]+ != sender.s") as err:
        tx.commit("s2", 2, dict(enumerate(sums2)))
    assert err.value.code == "DATA_LOSS"
    assert tx.state == getattr(rollout_pb2, after) and tx.version == 1 and tx.pending_sync_id == ""
    if after == "SERVING":
        assert torch.equal(_logits(tx), target.score(IDS, 1)[1])
    assert not torch.equal(before, target.score(IDS, 1)[1])


def test_parameters_the_copy_cannot_write_directly_are_loaded_by_the_engine_instead():
    """writable_params names a parameter copy_into declines (not contiguous): the bucket is then
    loaded through load_weights, checked as before, and the result is still exact."""
    target, eng = _engine(1), _engine(2)
    tx = SyncTransaction(eng, "inplace")
    m, bufs = _buckets(target)
    own = eng.writable_params

    def awkward(metas):
        params = own(metas)
        if params is None:
            return None
        first = params[0]  # a stand-in of the same shape and dtype, every other element: not contiguous
        params[0] = torch.empty(first.numel() * 2, dtype=first.dtype)[::2].view(first.shape)
        assert not params[0].is_contiguous()
        return params

    eng.writable_params = awkward
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, bucket_checksum(buf), defer_check=True)
    tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    for name, p in target._params.items():
        assert torch.equal(eng._params[name], p), name


def test_an_abort_is_taken_at_once_while_a_staged_commit_waits_for_a_busy_engine():
    """The commit waits for the engine outside the transaction's state lock: the trainer's abort (or
    SIGTERM's, or a newer prepare) answers at once and ends the wait, instead of queueing behind it
    until the sync's deadline; the old version keeps serving."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    tx, before, bufs = _staged_sync_all_received(timeout=20.0)
    release, busy = _generation_holding_the_engine(tx)
    sums = {i: bucket_checksum(b) for i, b in enumerate(bufs)}
    with ThreadPoolExecutor(2) as pool:
        commit = pool.submit(tx.commit, "s1", 1, sums)
        time.sleep(0.3)  # the commit is now waiting for the engine
        assert not commit.done()
        with pytest.raises(SyncError, match="already being committed"):
            tx.commit("s1", 1, sums)  # a second commit of the same sync does not queue a second apply
        _abort_ends_the_wait(tx, pool, commit, "aborted while its commit waited for the engine")
    _still_serving_version_0(tx, release, busy, before)


def test_an_abort_is_taken_at_once_while_an_inplace_sync_waits_to_pause_generation():
    """An inplace sync's first bucket waits for running generations outside the state lock: an abort
    answers at once and ends the wait; nothing was loaded, so the old version keeps serving."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    target, eng = _engine(1), _engine(2)
    tx = SyncTransaction(eng, "inplace")
    before = _logits(tx)
    m, bufs = _buckets(target)
    tx.prepare(m, timeout=20.0)
    release, busy = _generation_holding_the_engine(tx)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(tx.consume_bucket, "s1", 0, bufs[0], bucket_checksum(bufs[0]))
        time.sleep(0.3)  # the first bucket now waits for the generation to leave the engine
        assert not first.done()
        _abort_ends_the_wait(tx, pool, first, "aborted while it waited to pause generation")
    _still_serving_version_0(tx, release, busy, before)


def test_a_layout_checked_once_is_not_walked_again_and_other_layouts_are_still_checked(monkeypatch):
    import rollout_svc.sync.transaction as txmod
    from weightsync.bus.layout import layout_digest

    tx = SyncTransaction(_engine(2), "staged")
    m, _ = _buckets(_engine(1))
    m.layout_digest = layout_digest(m)
    walks, plan = [], txmod.plan_apply

    def counting_plan(engine, manifest):
        walks.append(manifest.sync_id)
        return plan(engine, manifest)

    monkeypatch.setattr(txmod, "plan_apply", counting_plan)
    tx.validate(m)
    tx.validate(m)
    assert walks == ["s1"]  # the second prepare of the same layout skipped the walk
    wrong = make_manifest(
        [
            TensorMeta(n, (3,) if i == 0 else s.meta.shape, s.meta.dtype)
            for i, (n, s) in enumerate((s.meta.name, s) for b in m.buckets for s in b.slots)
        ],
        version=2,
        sync_id="s2",
        bucket_bytes=64 << 10,
        checksum_algo=ALGO,
    )
    wrong.layout_digest = layout_digest(wrong)
    with pytest.raises(SyncError, match="trainer sends shape \\[3\\]"):
        tx.validate(wrong)
    undigested = make_manifest(m.metas(), version=3, sync_id="s3", bucket_bytes=64 << 10, checksum_algo=ALGO)
    tx.validate(undigested)
    tx.validate(undigested)
    assert walks == ["s1", "s2", "s3", "s3"]  # no digest: checked every time


def test_a_block_fp8_layout_is_checked_once_and_each_sync_gets_its_own_dequantizer(monkeypatch):
    """A quantized layout is remembered too (pairing every weight with its scale cost 1.6 ms a 7B-sized
    sync), but each sync loads through a dequantizer of its own: one holds unpaired halves."""
    import rollout_svc.sync.transaction as txmod
    from weightsync.bus.layout import ManifestCache
    from weightsync.formats.fp8.export import export_metas
    from weightsync.formats.fp8.spec import BLOCK_FP8

    eng = _engine(2)
    tx = SyncTransaction(eng, "inplace")
    plain = [TensorMeta(n, tuple(m.shape), torch.bfloat16) for n, m in eng.param_metas().items()]
    cache = ManifestCache()
    fp8 = cache.manifest(export_metas(plain), version=1, sync_id="s1", bucket_bytes=1 << 20, quantization=BLOCK_FP8)
    same_bf16 = cache.manifest(plain, version=2, sync_id="s2", bucket_bytes=1 << 20)
    walks, plan = [], txmod.plan_apply

    def counting_plan(engine, manifest):
        walks.append(manifest.sync_id)
        return plan(engine, manifest)

    monkeypatch.setattr(txmod, "plan_apply", counting_plan)
    first, second = tx.validate(fp8), tx.validate(fp8)
    assert walks == ["s1"]
    assert first is not None and second is not None and first is not second
    name = next(m.name for m in plain if m.name.endswith("q_proj.weight"))
    assert first.dtype_of(name) == second.dtype_of(name) == eng.param_metas()[name].dtype
    assert tx.validate(same_bf16) is None and walks == ["s1", "s2"]  # an unquantized layout is another key


def test_a_commit_after_the_receiver_aborted_on_a_corrupted_bucket_is_data_loss():
    """The receiver aborts the sync on a bad bucket; a CommitSync that comes after (the trainer saw
    its stream end without an error) is answered DATA_LOSS with the checksum reason, not 'not
    prepared here', and AbortSync can tell the trainer why (`aborted_here`)."""

    class _Receiver:
        def __init__(self, bufs, sums):
            self.items, self.closed = list(zip(bufs, sums)), False

        def recv(self, plan, timeout):
            return self.items[plan.index]

        def close(self):
            self.closed = True

    target, eng = _engine(1), _engine(2)
    tx = SyncTransaction(eng, "staged")
    m, bufs = _buckets(target)
    sums = [bucket_checksum(b) for b in bufs]
    bufs[0][5] ^= 0x01
    tx.prepare(m, timeout=30)
    receiver = _Receiver(bufs, sums)
    tx.run_receiver("s1", receiver)
    assert receiver.closed and tx.pending_sync_id == ""
    assert tx.aborted_here[0] == "s1" and tx.aborted_here[1].startswith("DATA_LOSS: bucket 0: checksum")
    with pytest.raises(SyncError, match=r"aborted here: bucket 0: checksum .* \(corrupted in transit\)") as err:
        tx.commit("s1", 1, dict(enumerate(sums)))
    assert err.value.code == "DATA_LOSS"
    with pytest.raises(SyncError, match="not prepared here"):  # any other sync: as before
        tx.commit("s2", 1, {})


def test_a_commit_between_a_failed_receive_and_its_abort_keeps_the_failures_code():
    """The receive thread records why a sync failed (code first) before it aborts it; a commit that lands in
    between is refused with that code (DATA_LOSS), not as a plain precondition failure."""
    tx = SyncTransaction(_engine(2), "staged")
    m, bufs = _buckets(_engine(1))
    tx.prepare(m, timeout=30)
    why = "bucket 0: checksum 0x1 != sender's 0x2 (corrupted in transit)"
    with tx.state_lock:  # the receive thread's first two steps, before abort_locked
        tx.aborted_here = ("s1", f"DATA_LOSS: {why}")
        tx._pending.error = why
    with pytest.raises(SyncError, match="already failed: bucket 0") as err:
        tx.commit("s1", 1, {b.index: bucket_checksum(buf) for b, buf in zip(m.buckets, bufs)})
    assert err.value.code == "DATA_LOSS"
