"""trainer_writes.py on a CPU: the destination table a rollout offers, the trainer's validation of it
(every refusal names the tensor), the direction chosen, and the write pass itself (verified_copy's
copy-and-sum, which on a CPU copies and sums with torch): exact bytes and the bucket checksums the
packed buckets have. The CUDA IPC handles are stood in for by a fake that maps a handle back to the
same memory; tests/gpu/test_trainer_writes_gpu.py runs the real handles and the fused kernel."""

from __future__ import annotations

import argparse

import pytest
import torch

from trainer_svc.config import TrainerConfig
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.ipc.trainer_writes import (
    DestinationError,
    Destinations,
    TrainerWriteSender,
    check,
    choose,
    layout_id,
    offer,
)
from weightsync.bus.pack import pack_bucket
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.config import ConfigError, add_arguments, resolve
from weightsync.v1 import bus_pb2


class FakeIpc:
    """Handles name storages of this process: `open` gives back the same memory, as a mapping would."""

    def __init__(self):
        self.memory: dict[bytes, torch.Tensor] = {}
        self.opens = 0

    def share(self, whole: torch.Tensor) -> bus_pb2.CudaIpcHandle:
        assert whole.storage_offset() == 0 and whole.dtype == torch.uint8
        key = f"h{whole.data_ptr()}".encode()
        self.memory[key] = whole
        return bus_pb2.CudaIpcHandle(handle=key, storage_size=whole.numel())

    def open(self, h: bus_pb2.CudaIpcHandle) -> torch.Tensor:
        self.opens += 1
        return self.memory[bytes(h.handle)]


# an odd-sized bf16 tensor (its last 2 bytes are not a whole word) and gaps between slots
METAS = [
    TensorMeta("a", (5, 7), torch.bfloat16),
    TensorMeta("b", (64,), torch.float32),
    TensorMeta("c", (3,), torch.bfloat16),
    TensorMeta("d", (300, 8), torch.bfloat16),
    TensorMeta("e", (9,), torch.int64),
]


def _manifest(bucket_bytes=1 << 12):
    return make_manifest(METAS, version=1, sync_id="s1", bucket_bytes=bucket_bytes, checksum_algo="ws-sum64-v1")


def _engine(seed=0):
    """The engine's parameters: some in one shared storage (views at offsets), some on their own."""
    g = torch.Generator().manual_seed(seed)
    arena = torch.zeros(4096, dtype=torch.uint8)
    a = arena[64 : 64 + 70].view(torch.bfloat16).view(5, 7)
    c = arena[256 : 256 + 6].view(torch.bfloat16)
    params = {
        "a": a,
        "b": torch.randn(64, generator=g),
        "c": c,
        "d": torch.zeros(300, 8, dtype=torch.bfloat16),
        "e": torch.zeros(9, dtype=torch.int64),
    }
    return params


def _trainer_tensors(seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in METAS:
        if m.dtype == torch.int64:
            out.append((m.name, torch.randint(-(2**62), 2**62, m.shape, generator=g)))
        else:
            out.append((m.name, (torch.randn(m.shape, generator=g) * 10).to(m.dtype)))
    return out


def _in_order(manifest, params):
    return [params[s.meta.name] for plan in manifest.buckets for s in plan.slots]


def test_the_offer_shares_each_storage_once_and_the_table_maps_back_onto_the_parameters():
    manifest, params, ipc = _manifest(), _engine(), FakeIpc()
    table = offer(manifest, _in_order(manifest, params), ipc.share)
    assert len(table.allocations) == 4  # a and c share one storage
    assert {t.name: t.offset for t in table.tensors}["c"] == 256
    dests = Destinations(manifest, table, ipc.open)
    assert ipc.opens == 4
    for plan, views in zip(manifest.buckets, dests.buckets, strict=True):
        for slot, v in zip(plan.slots, views, strict=True):
            p = params[slot.meta.name]
            assert v.data_ptr() == p.data_ptr() and v.numel() == slot.meta.nbytes
    # the id names the layout and the addresses: another engine's memory is another table
    assert layout_id(manifest, _in_order(manifest, params)) == layout_id(manifest, _in_order(manifest, params))
    assert layout_id(manifest, _in_order(manifest, params)) != layout_id(manifest, _in_order(manifest, _engine()))


def test_an_engine_parameter_unlike_the_manifest_is_not_offered():
    manifest, params = _manifest(), _engine()
    params["d"] = torch.zeros(8, 300, dtype=torch.bfloat16)
    with pytest.raises(DestinationError, match=r"tensor d: the engine's parameter is torch.bfloat16 \[8, 300\]"):
        offer(manifest, _in_order(manifest, params), FakeIpc().share)


def _table():
    manifest, params, ipc = _manifest(), _engine(), FakeIpc()
    return manifest, offer(manifest, _in_order(manifest, params), ipc.share)


def _edit(table, tensor, **fields):
    t = next(t for t in table.tensors if t.name == tensor)
    for k, v in fields.items():
        if k == "shape":
            del t.shape[:]
            t.shape.extend(v)
        else:
            setattr(t, k, v)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: _edit(t, "b", dtype=bus_pb2.BFLOAT16), "tensor b: destination dtype torch.bfloat16 != manifest's"),
        (lambda t: _edit(t, "d", shape=[8, 300]), r"tensor d: destination shape \[8, 300\] != manifest's \[300, 8\]"),
        (lambda t: _edit(t, "a", nbytes=72), "tensor a: destination nbytes 72 != manifest's 70"),
        (lambda t: _edit(t, "e", allocation=9), r"tensor e: allocation 9 out of range \(the table shares 4\)"),
        (lambda t: _edit(t, "c", offset=4094), "tensor c: bytes .* run past its allocation's 4096"),
        (lambda t: _edit(t, "c", offset=258), "tensor c: offset 258 is not on a 4-byte boundary"),
        (lambda t: _edit(t, "d", name="zz"), "tensor d: the rollout's destination table lacks it"),
        (lambda t: t.tensors.add().CopyFrom(t.tensors[0]), "tensor a: two destinations"),
    ],
)
def test_a_table_unlike_the_manifest_is_refused_naming_the_tensor(change, message):
    manifest, table = _table()
    check(manifest, table)  # as offered: accepted
    change(table)
    with pytest.raises(DestinationError, match=message):
        Destinations(manifest, table, FakeIpc().open)


def test_a_tensor_the_manifest_lacks_is_refused():
    manifest, table = _table()
    extra = table.tensors.add()
    extra.CopyFrom(table.tensors[0])
    extra.name = "not_in_the_model"
    with pytest.raises(DestinationError, match="tensor not_in_the_model: in the rollout's destination table but not"):
        check(manifest, table)


def test_the_direction():
    assert choose("auto", 1, offered=True) == "trainer_writes"
    assert choose("auto", 1, offered=False) == "rollout_reads"  # staged, SGLang, quantized: the rollout reads
    assert choose("auto", 2, offered=True) == "rollout_reads"  # several targets share the trainer's buffers
    assert choose("rollout_reads", 1, offered=True) == "rollout_reads"
    assert choose("trainer_writes", 1, offered=True) == "trainer_writes"
    with pytest.raises(ValueError, match="ipc_direction='sideways' must be auto, rollout_reads, trainer_writes"):
        choose("sideways", 1, offered=True)


def _resolve(argv, env):
    p = argparse.ArgumentParser()
    add_arguments(p, TrainerConfig, "WS_TRAINER")
    return resolve(TrainerConfig, p.parse_args(argv), "WS_TRAINER", env)


def test_the_config_knob_from_flags_and_env():
    assert _resolve([], {}).bus.ipc_direction == "auto"
    assert _resolve([], {"WS_TRAINER_IPC_DIRECTION": "rollout_reads"}).bus.ipc_direction == "rollout_reads"
    assert _resolve(["--ipc-direction", "trainer_writes"], {}).bus.ipc_direction == "trainer_writes"
    with pytest.raises(ConfigError, match="ipc_direction: 'sideways' is not one of"):
        _resolve([], {"WS_TRAINER_IPC_DIRECTION": "sideways"})


@pytest.mark.parametrize("bucket_bytes", [1 << 12, 256])  # several buckets; oversized tensors on their own
@pytest.mark.parametrize("packed", [True, False])
def test_the_write_pass_lands_every_byte_and_sums_what_the_buckets_hold(bucket_bytes, packed):
    manifest, params, ipc = _manifest(bucket_bytes), _engine(), FakeIpc()
    dests = Destinations(manifest, offer(manifest, _in_order(manifest, params), ipc.share), ipc.open)
    tensors = _trainer_tensors()
    # the reference: each bucket packed as rollout_reads would share it, and its checksum
    want = []
    it = iter(tensors)
    for plan in manifest.buckets:
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, (next(it) for _ in plan.slots), buf)
        want.append((buf.clone(), bucket_checksum(buf)))
    sender = TrainerWriteSender(dests, "r")
    in_place = None if packed else [b for b, _ in want]
    stats = stream_buckets(manifest, iter(tensors), sender, in_place=in_place)
    assert stats.checksums == [c for _, c in want]
    for name, t in tensors:
        assert torch.equal(params[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    arena = torch.empty(0, dtype=torch.uint8).set_(params["a"].untyped_storage())
    untouched = torch.ones(arena.numel(), dtype=torch.bool)
    untouched[64 : 64 + 70] = untouched[256 : 256 + 6] = False
    assert not arena[untouched].any()  # nothing written outside the parameters (the buckets' gaps stay home)


class _OnlyAtOnce(TrainerWriteSender):
    def send(self, plan, buf, checksum):
        raise AssertionError(f"bucket {plan.index} handed over on its own")


@pytest.mark.parametrize("bucket_bytes", [1 << 12, 256])
def test_the_actors_own_buckets_go_all_at_once_without_a_producer_thread(bucket_bytes, monkeypatch):
    import threading

    manifest, params, ipc = _manifest(bucket_bytes), _engine(), FakeIpc()
    dests = Destinations(manifest, offer(manifest, _in_order(manifest, params), ipc.share), ipc.open)
    tensors = _trainer_tensors(seed=5)
    bufs, want = [], []
    it = iter(tensors)
    for plan in manifest.buckets:
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, (next(it) for _ in plan.slots), buf)
        bufs.append(buf)
        want.append(bucket_checksum(buf))
    started = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name))
    sent = []
    stats = stream_buckets(manifest, iter(()), _OnlyAtOnce(dests, "r"), in_place=bufs, on_sent=sent.append)
    assert started == [] and stats.checksums == want
    assert sent == [p.nbytes for p in manifest.buckets] and stats.bytes_sent == manifest.total_bytes
    for name, t in tensors:
        assert torch.equal(params[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def _random_buckets(manifest, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for m in [s.meta for plan in manifest.buckets for s in plan.slots]:
        words = torch.randint(-(2**31), 2**31 - 1, (m.nbytes // 4 + 1,), generator=g, dtype=torch.int32)
        tensors.append((m.name, words.view(torch.uint8)[: m.nbytes].view(m.dtype).view(m.shape)))
    bufs, want, it = [], [], iter(tensors)
    for plan in manifest.buckets:
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, (next(it) for _ in plan.slots), buf)
        bufs.append(buf)
        want.append(bucket_checksum(buf))
    return tensors, bufs, want


def test_every_bucket_at_once_lands_and_sums_as_copy_into_and_a_bad_layout_copies_nothing():
    """verified_copy.copy_all_into (the actor's own buckets, all queued at once): the bytes land as
    `copy_into` lands them and each bucket's sums give its bucket_checksum, over fresh contents in the
    same buffers; a destination that cannot take its slot as words leaves every destination untouched.
    tests/gpu/test_trainer_writes_gpu.py runs it with the fused kernel."""
    from weightsync.bus.copy.verified_copy import copy_all_into, pending_values

    metas = [*METAS, TensorMeta("f", (5000, 3), torch.float32)]
    manifest = make_manifest(metas, version=1, sync_id="s", bucket_bytes=1 << 12, checksum_algo="ws-sum64-v1")
    assert any(p.nbytes % 4 for p in manifest.buckets)  # a bucket whose last bytes are not a whole word
    params = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas}
    dests = [[params[s.meta.name] for s in plan.slots] for plan in manifest.buckets]
    for seed in (3, 4):
        tensors, bufs, want = _random_buckets(manifest, seed)
        assert pending_values(copy_all_into(manifest.buckets, bufs, dests)) == want, seed
        for name, t in tensors:
            assert torch.equal(params[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    before = {n: t.clone() for n, t in params.items()}
    _, bufs, _ = _random_buckets(manifest, 5)
    bad = [list(d) for d in dests]
    bad[-1][-1] = torch.zeros(bad[-1][-1].numel() + 1, dtype=bad[-1][-1].dtype)  # one element too many
    assert copy_all_into(manifest.buckets, bufs, bad) is None

    def raw(t):  # the values hold NaNs (random words): compare bytes
        return t.reshape(-1).view(torch.uint8)

    assert all(torch.equal(raw(before[n]), raw(params[n])) for n in params)
    with pytest.raises(ValueError, match="destinations for"):
        copy_all_into(manifest.buckets, bufs, [d[:-1] for d in dests])


class _Entry:
    def __init__(self, rid):
        self.rollout_id = rid


def _ipc_sender(direction, ipc):
    from weightsync.bus.ipc.sender import IpcSender

    return IpcSender(
        torch.device("cpu"),
        call=None,
        uuid_of=lambda d: "GPU-0",
        needs_cuda=False,
        direction=direction,
        open_fn=ipc.open,
    )


def _answer(table_id="", table=None):
    from weightsync.v1 import rollout_pb2

    resp = rollout_pb2.PrepareSyncResponse()
    resp.transport.ipc.device_uuid = "GPU-0"
    resp.transport.ipc.dest_layout = table_id
    if table is not None:
        resp.transport.ipc.destinations.CopyFrom(table)
    return resp


def test_the_trainer_asks_one_target_only_and_names_the_table_it_holds():
    manifest, params, ipc = _manifest(), _engine(), FakeIpc()
    table = offer(manifest, _in_order(manifest, params), ipc.share)
    sender = _ipc_sender("auto", ipc)
    s = sender.begin([_Entry("r")], "s1", 1 << 20)
    s.use_manifest(manifest)
    assert s.spec_for(_Entry("r")).ipc.trainer_writes and s.spec_for(_Entry("r")).ipc.dest_layout == ""
    assert not s.expects_channel_sums  # nothing known of the target yet: the trainer starts its own sums
    assert s.accept(_Entry("r"), _answer("t1", table)) == "" and s.direction == "trainer_writes"
    assert isinstance(s.open({"r": _Entry("r")}, 10), TrainerWriteSender) and not s.commit_on_stream
    # the next sync names the table it holds; the answer names it back without the table
    s = sender.begin([_Entry("r")], "s2", 1 << 20)
    s.use_manifest(manifest)
    assert s.spec_for(_Entry("r")).ipc.dest_layout == "t1" and s.expects_channel_sums
    assert s.accept(_Entry("r"), _answer("t1")) == "" and s.direction == "trainer_writes"
    assert ipc.opens == 4  # mapped once, for both syncs
    assert "which this trainer does not hold" in s.accept(_Entry("r"), _answer("t2"))
    # two targets share the trainer's buffers (the rollouts read); a target no longer synced is unmapped
    s = sender.begin([_Entry("a"), _Entry("b")], "s3", 1 << 20)
    assert not s.spec_for(_Entry("a")).ipc.trainer_writes and "r" not in sender.dests
    assert s.accept(_Entry("a"), _answer()) == "" and s.direction == "rollout_reads"


def test_rollout_reads_never_asks_and_trainer_writes_fails_a_target_that_offers_nothing():
    ipc = FakeIpc()
    s = _ipc_sender("rollout_reads", ipc).begin([_Entry("r")], "s1", 1 << 20)
    assert not s.spec_for(_Entry("r")).ipc.trainer_writes
    s = _ipc_sender("trainer_writes", ipc).begin([_Entry("r")], "s1", 1 << 20)
    s.use_manifest(_manifest())
    assert "ipc_direction=trainer_writes: the rollout offers no destination table" in s.accept(_Entry("r"), _answer())
    s = _ipc_sender("auto", ipc).begin([_Entry("r")], "s1", 1 << 20)
    assert s.accept(_Entry("r"), _answer()) == "" and s.direction == "rollout_reads"  # staged, SGLang: it reads


def test_only_a_channel_that_can_drop_a_target_has_its_targets_watched_mid_stream():
    """The stream's liveness watch (a thread pinging every target's link) only serves a channel that can
    drop one target (tcp); the trainer writing into the engine keeps its one target to the end."""
    from weightsync.bus.channel import drops_targets
    from weightsync.bus.ipc.sender import IpcStreamSender
    from weightsync.bus.tcp.wire import TcpBucketSender
    from weightsync.publisher.delta_sync import _DeltaChannel

    assert not drops_targets(TrainerWriteSender.__new__(TrainerWriteSender))
    assert not drops_targets(IpcStreamSender.__new__(IpcStreamSender))
    assert drops_targets(TcpBucketSender.__new__(TcpBucketSender))
    assert drops_targets(_DeltaChannel.__new__(_DeltaChannel))  # forwards drop to the tcp channel it wraps


def test_a_quantized_manifest_is_asked_for_only_with_its_writer_and_says_so():
    """Without a writer for its quantization (weightsync/formats, which the publisher hands the session)
    a quantized sync never asks for a table, expects no channel sums and runs rollout_reads even if a
    rollout answers with one; with it, the request says the trainer writes dequantized tensors."""
    import dataclasses

    from weightsync.bus.plan import Quantization

    manifest, ipc = _manifest(), FakeIpc()
    quantized = dataclasses.replace(manifest, quantization=Quantization("fp8", "e4m3", (128, 128)))
    sender = _ipc_sender("auto", ipc)
    sender.dests["r"] = ("t1", object())  # a table held from an earlier sync
    s = sender.begin([_Entry("r")], "s1", 1 << 20)
    s.use_manifest(quantized)
    spec = s.spec_for(_Entry("r"))
    assert not spec.ipc.trainer_writes and not spec.ipc.writes_dequantized and not s.expects_channel_sums
    assert s.accept(_Entry("r"), _answer("t1")) == "" and s.direction == "rollout_reads"
    s.use_quantized_writes(object())
    spec = s.spec_for(_Entry("r"))
    assert spec.ipc.trainer_writes and spec.ipc.writes_dequantized and s.expects_channel_sums
    s = sender.begin([_Entry("r")], "s2", 1 << 20)
    s.use_manifest(manifest)  # unquantized: no writer needed, and the request says nothing of dequantizing
    spec = s.spec_for(_Entry("r"))
    assert spec.ipc.trainer_writes and not spec.ipc.writes_dequantized
