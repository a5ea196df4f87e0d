"""A block-FP8 sync that the trainer writes into the engine (CUDA IPC, trainer_writes), through the real
services on a CPU: export_dtype fp8-block, the built-in engine (which dequantizes) in inplace mode.

The rollout's table covers the tensors as its engine holds them (each FP8 weight its bf16/fp32
parameter, no scale); the trainer writes every weight dequantized and commits the sums of the FP8
buckets. What the engine holds afterwards and the version's checksum must be exactly what an FP8
rollout_reads sync of the same weights gives. Only the GPU boundary is faked (tests/support/fake_gpu.py);
the packed export is what a CPU trainer sends (the megatron actor's fused path from its own buckets:
tests/gpu/test_trainer_writes_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support.fake_gpu import FakeGpu, fake_gpu_boundary
from tests.support.fleet_sync import bump_weights
from tests.support.local_apps import local_fleet
from weightsync.v1 import bus_pb2, rollout_pb2, trainer_pb2

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def pair():
    gpu = FakeGpu()
    # a bf16 engine: the unquantized tensors (embeddings, norms) travel as bf16 and are copied as words
    fleet = local_fleet({"a": {"apply_mode": "inplace", "dtype": "bfloat16"}}, TOKEN, export_dtype="fp8-block")
    with fleet as (trainer, rollouts, stub):
        fake_gpu_boundary(trainer, rollouts["a"], gpu)
        trainer.orch.bucket_bytes = 64 << 10  # several buckets, scales before their weights across them
        yield trainer, rollouts["a"], stub, gpu


def _sync(stub, direction: str):
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc", ipc_direction=direction)).report
    assert report.ok, [r.error for r in report.rollouts]
    return report


def _params(app) -> dict[str, torch.Tensor]:
    return {n: app.engine._target(n).detach().clone() for n in app.engine.param_metas()}


def _poison(app) -> None:
    with torch.no_grad():
        for n in app.engine.param_metas():
            app.engine._target(n).fill_(float("nan"))


def test_the_trainer_writes_an_fp8_sync_as_rollout_reads_applies_it(pair):
    trainer, app, stub, gpu = pair
    for _ in range(2):
        bump_weights(trainer)
        report = _sync(stub, "rollout_reads")
        assert "stream.trainer_writes" not in report.phase_seconds
        read, read_sum = _params(app), app.tx.weights_checksum
        assert any(p.dtype == torch.bfloat16 or p.dtype == torch.float32 for p in read.values())
        _poison(app)  # every value the writes leave out would stay NaN
        report = _sync(stub, "trainer_writes")  # the same version, written by the trainer
        assert "stream.trainer_writes" in report.phase_seconds and report.num_buckets > 2
        written = _params(app)
        assert written.keys() == read.keys()
        for n, t in read.items():
            assert torch.equal(written[n], t), n
        assert app.tx.weights_checksum == read_sum and app.tx.state == rollout_pb2.SERVING
    ((_, (_, table)),) = app.servicer.ipc._offers.items()
    names = {t.name for t in table.tensors}
    assert names and not any(n.endswith("_scale_inv") for n in names)  # no scale has a destination
    m = _fp8_manifest(trainer, "s")
    fp8 = [s.meta for b in m.buckets for s in b.slots if s.meta.dtype == torch.float8_e4m3fn]
    assert fp8
    by_name = {t.name: t for t in table.tensors}
    for meta in fp8:  # each FP8 weight as the engine's parameter
        assert by_name[meta.name].dtype != bus_pb2.FLOAT8_E4M3FN and tuple(by_name[meta.name].shape) == meta.shape


@pytest.mark.parametrize("edit", ["fp8_dtype", "scale_destination"])
def test_a_table_that_does_not_match_the_fp8_manifest_is_refused_naming_the_tensor(pair, edit):
    trainer, app, stub, _ = pair
    bump_weights(trainer)
    _sync(stub, "auto")
    ipc_end, sender = app.servicer.ipc, trainer.orch.transports["ipc"]
    ((key, (table_id, table)),) = ipc_end._offers.items()
    bad = bus_pb2.IpcDestinations()
    bad.CopyFrom(table)
    metas = {m.name: m for m in trainer.orch.export_format.metas(trainer.actor.export_metas())}
    weight = next(n for n in metas if n + "_scale_inv" in metas)
    t = next(t for t in bad.tensors if t.name == weight)
    if edit == "fp8_dtype":
        t.dtype = bus_pb2.FLOAT16
        want = f"tensor {weight}: destination dtype torch.float16; the trainer writes this torch.float8_e4m3fn weight"
    else:
        bad.tensors.add().CopyFrom(t)
        bad.tensors[-1].name = weight + "_scale_inv"
        want = f"tensor {weight}_scale_inv: has a destination in the rollout's table"
    ipc_end._offers[key] = ("bad-" + table_id, bad)
    bump_weights(trainer)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc", ipc_direction="trainer_writes")).report
    assert not report.ok
    (r,) = report.rollouts
    assert want in r.error and "refused" in r.error, r.error
    assert app.tx.state == rollout_pb2.STALE and "a" not in sender.dests
    ipc_end._offers.clear()
    _sync(stub, "trainer_writes")
    assert app.tx.state == rollout_pb2.SERVING and app.tx.version == trainer.actor.version


def test_a_rollout_whose_engine_loads_fp8_pairs_offers_no_table(pair, monkeypatch):
    """An engine that runs the FP8 weights itself (SGLang serving an FP8 checkpoint) takes the pairs as
    they are: nothing for the trainer to write dequantized; auto falls back to rollout_reads."""
    trainer, app, stub, _ = pair
    monkeypatch.setattr(app.engine, "loads_quantized", lambda q: True, raising=False)
    m = _fp8_manifest(trainer, "s2")
    app.servicer.ipc._offers.clear()
    assert app.tx.write_metas(m) is None and app.servicer.ipc.destinations(m) is None
    app.servicer.ipc._offers.clear()


class FlatFp8:
    """What megatron's flat export does on a GPU (trainer_svc/actor/megatron/flat_buckets.py), for the hf
    actor on the CPU: the manifest's buckets as flat buffers, the 16-bit tensors written into their
    slots at each call and the FP8 weights quantized into theirs from the parameters (fp8/quantize_slots.py's
    torch path), unless `quantize=False`. Records each call's `quantize`."""

    def __init__(self, trainer):
        self.trainer, self.calls, self._flats, self._quant = trainer, [], None, None

    def install(self, monkeypatch) -> None:
        actor = self.trainer.actor
        for name in ("flat_buckets", "flat_fp8_weights", "flat_quantize", "flat_known_sums"):
            monkeypatch.setattr(actor, name, getattr(self, name.removeprefix("flat_")), raising=False)
        # and says so, as megatron's actor declares it (WeightSource.fp8_weights_from_parameters)
        monkeypatch.setattr(actor, "fp8_weights_from_parameters", True, raising=False)

    def buckets(self, manifest, quantize: bool = True):
        from weightsync.formats.fp8 import quantize_slots

        self.calls.append(quantize)
        params = dict(self.trainer.actor.export_tensors())  # the parameters themselves (float32)
        slots = {s.meta.name: (k, s) for k, b in enumerate(manifest.buckets) for s in b.slots}
        # fresh zeroed buffers at every call: FP8 slots left unwritten are zeros, never an older sync's bytes
        self._flats = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
        weights = []
        for name, (k, slot) in slots.items():
            if slot.meta.dtype == torch.float8_e4m3fn:
                sk, sslot = slots[name + "_scale_inv"]
                (si,) = quantize_slots.stand_ins([slot.meta.shape])
                weights.append(
                    quantize_slots.SlotWeight(name, k, slot.offset, sslot.offset, si, [(si, params[name])], sk)
                )
            elif name in params:  # (not a scale) the export's 16-bit tensors
                t = params[name].to(slot.meta.dtype).contiguous()
                self._flats[k][slot.offset : slot.offset + slot.meta.nbytes] = t.view(-1).view(torch.uint8)
        self._quant = quantize_slots.plan(self._flats, weights, use_kernel=False)
        if quantize:
            self.quantize()
        return self._flats

    def fp8_weights(self):
        return self._quant.weights

    def quantize(self):
        self._quant.run()
        return None if self._quant.finite() else self._quant.first_non_finite()

    def known_sums(self):
        return None  # the stream reads every word


@pytest.fixture
def flat(pair, monkeypatch):
    """The pair's trainer sending from its own buckets, as a GPU trainer does (StreamPhase._in_place
    takes them on a CUDA device only: the session's device is said to be one while it asks)."""
    from weightsync.publisher.stream_phase import StreamPhase

    trainer, app, stub, gpu = pair
    f = FlatFp8(trainer)
    f.install(monkeypatch)
    plain = StreamPhase._in_place

    def in_place(self):
        dev = self.session.device
        self.session.device = torch.device("cuda")  # (the buffers stay on the CPU)
        try:
            return plain(self)
        finally:
            self.session.device = dev

    monkeypatch.setattr(StreamPhase, "_in_place", in_place)
    return f


def test_from_the_actors_buckets_the_fp8_weights_are_not_quantized_first_and_a_refusal_falls_back(pair, flat):
    """Expected to write (its target offered a table last time), the trainer leaves the FP8 slots
    unwritten at prepare and dequantizes the weights from the parameters; when the rollout offers no
    table after all, the stream quantizes into the buckets then and the rollout reads them. Every way,
    the engine holds what an FP8 rollout_reads sync gives, and the same version checksum."""
    trainer, app, stub, _ = pair
    ipc_end = app.servicer.ipc
    bump_weights(trainer)
    report = _sync(stub, "rollout_reads")
    assert flat.calls == [True] and "stream.trainer_writes" not in report.phase_seconds
    read, read_sum = _params(app), app.tx.weights_checksum

    def written_as_read(report, writes: bool):
        assert ("stream.trainer_writes" in report.phase_seconds) == writes, report.phase_seconds
        # written: the writer took the FP8 weights from the parameters (nothing quantized in the stream)
        assert ("stream.quantize" in report.phase_seconds) != writes, report.phase_seconds
        got = _params(app)
        for n, t in read.items():
            assert torch.equal(got[n], t), n
        assert app.tx.weights_checksum == read_sum and app.tx.state == rollout_pb2.SERVING

    _poison(app)
    written_as_read(_sync(stub, "auto"), writes=True)  # no table held yet: quantized at prepare, written fused
    _poison(app)
    written_as_read(_sync(stub, "auto"), writes=True)
    assert flat.calls[-1] is False  # the table is held: nothing quantized at prepare
    offers = ipc_end.destinations
    ipc_end.destinations = lambda manifest: None  # the rollout offers no table this time
    try:
        _poison(app)
        report = _sync(stub, "auto")
    finally:
        ipc_end.destinations = offers
    assert flat.calls[-1] is False and "stream.quantize" in report.phase_seconds  # quantized in the stream
    written_as_read(report, writes=False)


def test_a_non_finite_weight_fails_the_written_sync_naming_it_and_the_rollout_serves_no_part_of_it(pair, flat):
    trainer, app, stub, _ = pair
    bump_weights(trainer)
    _sync(stub, "auto")
    _sync(stub, "auto")  # the table is held: the next sync defers the quantize
    version = app.tx.version
    names = [m.name for m in trainer.orch.export_format.metas(trainer.actor.export_metas())]
    bad = next(n for n in names if n + "_scale_inv" in names)
    with torch.no_grad():
        dict(trainer.actor.model.named_parameters())[bad][3, 5] = float("nan")
    try:
        trainer.actor.version += 1
        report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
        assert flat.calls[-1] is False and not report.ok
        (r,) = report.rollouts
        assert bad in r.error and "not finite" in r.error, r.error
        assert app.tx.state == rollout_pb2.STALE and app.tx.version == version
    finally:
        with torch.no_grad():
            dict(trainer.actor.model.named_parameters())[bad][3, 5] = 0.0
    _sync(stub, "auto")
    assert app.tx.state == rollout_pb2.SERVING and app.tx.version == trainer.actor.version


def _fp8_manifest(trainer, sync_id: str):
    return trainer.orch.manifests.manifest(
        trainer.orch.export_format.metas(trainer.actor.export_metas()),
        version=1,
        sync_id=sync_id,
        bucket_bytes=trainer.orch.bucket_bytes,
        quantization=trainer.orch.export_format.quantization,
    )


def test_a_trainer_that_cannot_write_dequantized_is_offered_no_table_for_an_fp8_sync(pair):
    """A trainer that predates `writes_dequantized` asks for trainer_writes of any manifest: the rollout
    offers it no table of its engine's tensors for a quantized one (it would be refused), and reads."""
    trainer, app, _, gpu = pair
    from tests.support.fake_gpu import GPU

    m = _fp8_manifest(trainer, "old-trainer")
    assert app.servicer.ipc.destinations(m) is not None
    for new in (False, True):
        spec = bus_pb2.TransportSpec()
        spec.ipc.device_uuid, spec.ipc.trainer_writes, spec.ipc.writes_dequantized = GPU, True, new
        resp = rollout_pb2.PrepareSyncResponse()
        app.servicer.ipc.prepare(spec, m, resp)
        assert bool(resp.transport.ipc.dest_layout) is new


def test_the_fp8_table_is_checked_against_the_pairs_naming_the_tensor(pair):
    """check() with the FP8 writer's dtypes: an FP8 weight missing or of another shape, an unquantized
    tensor of another dtype, a table with nothing but the FP8 metas' own dtypes (what a trainer would get
    from a rollout that did not dequantize) are refused naming the tensor; the rollout's own table passes."""
    from weightsync.bus.ipc.trainer_writes import DestinationError, check
    from weightsync.formats.fp8.trainer_writes import Fp8Writes

    trainer, app, _, _ = pair
    m = _fp8_manifest(trainer, "check")
    allowed = Fp8Writes().destination_dtypes(m)
    _, table = app.servicer.ipc.destinations(m)
    check(m, table, allowed)
    metas = {s.meta.name: s.meta for b in m.buckets for s in b.slots}
    weight = next(n for n in metas if n + "_scale_inv" in metas)
    plain = next(n for n, x in metas.items() if x.dtype == torch.bfloat16)

    def edited(name, **fields):
        bad = bus_pb2.IpcDestinations()
        bad.CopyFrom(table)
        t = next(t for t in bad.tensors if t.name == name)
        if fields.pop("drop", False):
            bad.tensors.remove(t)
        for k, v in fields.items():
            if k == "shape":
                del t.shape[:]
                t.shape.extend(v)
            else:
                setattr(t, k, v)
        return bad

    shape = list(metas[weight].shape)
    cases = [
        (edited(weight, drop=True), f"tensor {weight}: the rollout's destination table lacks it"),
        (edited(weight, shape=[shape[0] * 2, shape[1] // 2]), f"tensor {weight}: destination shape"),
        (edited(weight, nbytes=4), f"tensor {weight}: destination nbytes 4 != "),
        (edited(weight, dtype=bus_pb2.FLOAT8_E4M3FN), f"tensor {weight}: destination dtype torch.float8_e4m3fn;"),
        (edited(plain, dtype=bus_pb2.FLOAT32), f"tensor {plain}: destination dtype torch.float32 != manifest's"),
    ]
    for bad, want in cases:
        with pytest.raises(DestinationError) as err:
            check(m, bad, allowed)
        assert want in str(err.value), (want, str(err.value))
    # without the writer's dtypes (the FP8 metas themselves): a scale without destination, or a weight's dtype
    with pytest.raises(DestinationError, match=r"_scale_inv: the rollout's destination table lacks it|dtype torch\.bf"):
        check(m, table)
