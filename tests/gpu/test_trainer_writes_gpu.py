"""CUDA IPC with the trainer writing into the engine (weightsync/bus/ipc/trainer_writes.py) on a real GPU.

Two levels: two processes sharing real CUDA IPC handles (an 'engine' process offers its parameters,
this process validates, maps and writes with the fused copy-and-sum kernel: exact bytes after several
syncs, every checksum equal to bucket_checksum of the packed bucket, a wrong table refused), and the
real services (hf trainer, built-in rollout in inplace mode): every sync exact, no trainer buffer
mapped by the rollout. Block FP8: the fused quantize-dequantize write kernel compiled against the
quantizer then the dequantizer, and megatron fp8-block trainer_writes into the built-in engine against
an FP8 rollout_reads sync of the same weights. Run: pytest -m gpu tests/gpu/test_trainer_writes_gpu.py
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")


def _metas():
    from weightsync.bus.plan import TensorMeta

    # odd-sized tensors (a last half word), gaps between slots, one larger than a bucket
    return [
        TensorMeta("embed", (1000, 256), torch.bfloat16),
        TensorMeta("q", (255, 129), torch.bfloat16),
        TensorMeta("norm", (257,), torch.float32),
        TensorMeta("k", (3,), torch.bfloat16),
        TensorMeta("big", (2048, 1024), torch.bfloat16),
        TensorMeta("ids", (33,), torch.int64),
    ]


def _manifest():
    from weightsync.bus.plan import make_manifest

    m = make_manifest(_metas(), version=1, sync_id="s", bucket_bytes=1 << 20, checksum_algo="ws-sum64-v1")
    m.layout_digest = "gpu-test"
    return m


def _values(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's tensors of one sync, made on the CPU (the same bits in either process)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in _metas():
        if m.dtype == torch.int64:
            out.append((m.name, torch.randint(-(2**62), 2**62, m.shape, generator=g)))
        else:
            out.append((m.name, (torch.randn(m.shape, generator=g) * 3).to(m.dtype)))
    return out


def _engine_process(to_trainer, from_trainer) -> None:
    from weightsync.bus.ipc.handles import share
    from weightsync.bus.ipc.trainer_writes import offer

    torch.cuda.set_device(0)
    manifest = _manifest()
    # some parameters in one allocation (views at offsets), as an engine's may be
    arena = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    params = {}
    pos = 4096
    for m in [s.meta for b in manifest.buckets for s in b.slots]:
        if m.name in ("q", "k", "norm"):
            params[m.name] = arena[pos : pos + m.nbytes].view(m.dtype).view(m.shape)
            pos += -(-m.nbytes // 512) * 512
        else:
            params[m.name] = torch.zeros(m.shape, dtype=m.dtype, device="cuda:0")
    in_order = [params[s.meta.name] for b in manifest.buckets for s in b.slots]
    to_trainer.put(offer(manifest, in_order, share).SerializeToString())
    while True:
        seed = from_trainer.get(timeout=120)
        if seed is None:
            break
        torch.cuda.synchronize()
        ok = all(
            torch.equal(params[n].cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
            for n, t in _values(seed)
        )
        gaps = arena[:4096].count_nonzero().item()  # bytes before the first parameter: never written
        to_trainer.put((ok, gaps))


@needs_gpu
def test_the_trainer_writes_exact_bytes_with_the_bucket_checksums_across_processes():
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.ipc.handles import open_mapping
    from weightsync.bus.ipc.trainer_writes import DestinationError, Destinations, TrainerWriteSender
    from weightsync.bus.pack import pack_bucket
    from weightsync.bus.pipeline import stream_buckets
    from weightsync.v1 import bus_pb2

    ctx = mp.get_context("spawn")
    to_trainer, from_trainer = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine_process, args=(to_trainer, from_trainer), daemon=True)
    proc.start()
    try:
        manifest = _manifest()
        table = bus_pb2.IpcDestinations.FromString(to_trainer.get(timeout=120))
        dests = Destinations(manifest, table, open_mapping)
        assert len(dests.maps) == 4  # q, k and norm share the arena
        for seed in (1, 2, 3):
            tensors = [(n, t.to("cuda:0")) for n, t in _values(seed)]
            want = []
            it = iter(tensors)
            for plan in manifest.buckets:
                buf = torch.zeros(plan.nbytes, dtype=torch.uint8, device="cuda:0")
                pack_bucket(plan, (next(it) for _ in plan.slots), buf)
                want.append((buf, bucket_checksum(buf)))
            # the actor's own storage (every bucket in one launch, send_held), or packed
            in_place = [b for b, _ in want] if seed >= 2 else None
            stats = stream_buckets(
                manifest, iter(tensors), TrainerWriteSender(dests, "r"), device="cuda:0", in_place=in_place
            )
            assert stats.checksums == [c for _, c in want], seed
            from_trainer.put(seed)
            ok, gaps = to_trainer.get(timeout=120)
            assert ok and gaps == 0, (seed, ok, gaps)
        bad = bus_pb2.IpcDestinations()
        bad.CopyFrom(table)
        bad.tensors[2].nbytes += 4
        with pytest.raises(DestinationError, match=f"tensor {bad.tensors[2].name}: destination nbytes"):
            Destinations(manifest, bad, open_mapping)
    finally:
        from_trainer.put(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


@needs_gpu
def test_every_bucket_at_once_lands_and_sums_as_copy_into_bucket_by_bucket():
    """verified_copy.copy_all_into (the actor's own buckets, all queued with no wait between them)
    against copy_into bucket by bucket: the same bytes in the destinations and the same checksums, also
    on a second call with new contents in the same buffers."""
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.copy.verified_copy import copy_all_into, copy_into, pending_values
    from weightsync.bus.pack import pack_bucket

    manifest = _manifest()
    plans = manifest.buckets
    bufs = [torch.zeros(p.nbytes, dtype=torch.uint8, device="cuda:0") for p in plans]
    mine = {s.meta.name: torch.zeros(s.meta.shape, dtype=s.meta.dtype, device="cuda:0") for p in plans for s in p.slots}
    ref = {n: torch.zeros_like(t) for n, t in mine.items()}
    for seed in (4, 5):
        it = iter([(n, t.to("cuda:0")) for n, t in _values(seed)])
        for plan, buf in zip(plans, bufs):
            pack_bucket(plan, (next(it) for _ in plan.slots), buf)
        want = [bucket_checksum(b) for b in bufs]
        pending = copy_all_into(plans, bufs, [[mine[s.meta.name] for s in p.slots] for p in plans])
        got = pending_values(pending)
        one_by_one = [copy_into(p, b, [ref[s.meta.name] for s in p.slots]) for p, b in zip(plans, bufs)]
        assert got == want == one_by_one, seed
        for n, t in _values(seed):
            assert torch.equal(mine[n].cpu(), t) and torch.equal(ref[n].cpu(), t), (seed, n)


@needs_gpu
@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])  # the trainer's own storage; packed and cast
def test_services_sync_exactly_with_the_trainer_writing_into_the_engine(fleet, param_dtype):
    from test_services_gpu import _assert_exact, _load, _reference_logits, _sync, _weights_dir

    from weightsync.local.procs import wait_registered

    t = fleet.trainer(
        "--device",
        "cuda:0",
        "--transport",
        "ipc",
        "--export-dtype",
        "bfloat16",
        "--param-dtype",
        param_dtype,
        "--init-seed",
        "1",
    )
    t.wait_ready()
    r = fleet.rollout(
        "same-gpu", "--device", "cuda:0", "--dtype", "bfloat16", "--apply-mode", "inplace", trainer_proc=t
    )
    r.wait_ready()
    wait_registered(t.address, ["same-gpu"])
    for i, seed in enumerate((None, 9, 10)):
        if seed is not None:
            _load(t, _weights_dir(fleet.tmp, seed))
        rc, rep = _sync(t, "--rollout", "same-gpu")
        assert rc == 0 and rep["ok"] and rep["transport"] == "ipc", rep
        assert "stream.trainer_writes" in rep.get("phase_seconds", {}), rep
        _assert_exact(
            r, _reference_logits(t, fleet.tmp, f"tw{param_dtype}{i}", "cuda:0", torch.bfloat16), int(rep["version"])
        )
    # the rollout mapped nothing of the trainer's: the trainer wrote
    assert (r.metric("weightsync_ipc_handle_opens_total", 'role="rollout"') or 0) == 0


@needs_gpu
def test_megatron_bf16_trainer_writes_into_the_engine_exactly(fleet):
    """The benchmark's case: megatron-core bf16 parameters laid out as the buckets, written by the trainer
    straight into the colocated engine (auto), exact after a LoadWeights too."""
    pytest.importorskip("megatron.core")
    from test_services_gpu import _assert_exact, _load, _reference_logits, _sync, _weights_dir

    from weightsync.local.procs import wait_registered

    t = fleet.trainer(
        "--transport", "ipc", "--init-seed", "3", "--param-dtype", "bfloat16", "--export-dtype", "bfloat16",
        backend="megatron",
    )  # fmt: skip
    t.wait_ready(timeout=240)
    # in place: a staged rollout offers no destination table, and auto then reads from the trainer
    r = fleet.rollout(
        "r-mcore-tw", "--device", "cuda:0", "--dtype", "bfloat16", "--apply-mode", "inplace", trainer_proc=t
    )
    r.wait_ready()
    wait_registered(t.address, ["r-mcore-tw"])
    for i in range(3):
        if i == 2:
            _load(t, _weights_dir(fleet.tmp, 12))
        rc, rep = _sync(t)
        assert rc == 0 and rep["ok"] and "stream.trainer_writes" in rep.get("phase_seconds", {}), rep
        _assert_exact(r, _reference_logits(t, fleet.tmp, f"mcore-tw{i}", "cuda:0", torch.bfloat16), int(rep["version"]))


@needs_gpu
def test_the_fused_fp8_write_kernel_is_quantize_then_dequantize_compiled():
    """weightsync/formats/fp8/write_slots.py compiled (the CPU tests run it under Triton's interpreter): bf16
    and float32 parameters hold what quantize_slots' quantize then the rollout's dequantize give, bit for bit,
    and the sums are those of the FP8 and scale slots the quantizer writes."""
    from tests.support.fp8_weights import block_test_weights
    from weightsync.bus.copy.checksum import word_sums
    from weightsync.formats.fp8 import blocks as fp8
    from weightsync.formats.fp8 import quantize_slots, write_slots

    shapes = [(4096, 4096), (300, 128), (129, 256), (3, 130, 144), (260, 304)]
    named = [(f"w{i}", block_test_weights(s, "heavy", 40 + i, torch.bfloat16).cuda()) for i, s in enumerate(shapes)]
    pos, places = 0, []
    for s in shapes:
        s_off = -(-pos // 256) * 256
        q_off = -(-(s_off + 4 * int(torch.tensor(fp8.scale_shape(s)).prod())) // 256) * 256
        places.append((s_off, q_off))
        pos = q_off + int(torch.tensor(s).prod())
    weights = [
        quantize_slots.SlotWeight(n, 0, q_off, s_off, si, [(si, t)])
        for (n, t), si, (s_off, q_off) in zip(named, quantize_slots.stand_ins(shapes), places)
    ]
    flat = torch.zeros(pos + 3, dtype=torch.uint8, device="cuda:0")
    q = quantize_slots.plan([flat], weights)
    assert q.use_kernel
    q.run()
    want_sums = torch.zeros(1, 2, dtype=torch.int64, device="cuda:0")
    for start, end in q.slot_ranges()[0]:
        want_sums[0] += word_sums(flat[start:end].view(torch.int32))
    for dtype in (torch.bfloat16, torch.float32):
        dests = [torch.full(t.shape, float("nan"), dtype=dtype, device="cuda:0") for _, t in named]
        f = write_slots.plan(weights, dests, 1)
        assert f is not None and f.use_kernel and len(f.launches) == 1
        sums = f.run()
        assert f.finite() and torch.equal(sums, want_sums), dtype
        for (n, t), d, (s_off, q_off) in zip(named, dests, places):
            nq = t.numel()
            codes = flat[q_off : q_off + nq].view(torch.float8_e4m3fn).view(t.shape)
            scales = flat[s_off : s_off + 4 * int(torch.tensor(fp8.scale_shape(t.shape)).prod())].view(torch.float32)
            want = fp8.dequantize(codes, scales.view(fp8.scale_shape(t.shape)), dtype)
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert torch.equal(d.view(bits), want.view(bits)), (n, dtype)


@needs_gpu
def test_megatron_fp8_trainer_writes_into_the_engine_as_rollout_reads_applies_it(fleet):
    """export_dtype fp8-block from megatron's flat buckets into the built-in engine (inplace, bf16): the
    trainer writes the FP8 weights dequantized from its parameters (no quantize pass once the table is
    held), and the engine then holds exactly what an FP8 rollout_reads sync of the same weights gives (the
    same logits, bit for bit) with the same version checksum; also after a LoadWeights."""
    pytest.importorskip("megatron.core")
    from test_services_gpu import _load, _rollout_logits, _weights_dir

    from weightsync.control.client import channel, rollout_stub, trainer_stub
    from weightsync.local.procs import wait_registered
    from weightsync.v1 import rollout_pb2, trainer_pb2

    t = fleet.trainer(
        "--transport", "ipc", "--init-seed", "3", "--param-dtype", "bfloat16", "--export-dtype", "fp8-block",
        backend="megatron",
    )  # fmt: skip
    t.wait_ready(timeout=240)
    r = fleet.rollout(
        "r-mcore-fp8tw", "--device", "cuda:0", "--dtype", "bfloat16", "--apply-mode", "inplace", trainer_proc=t
    )
    r.wait_ready()
    wait_registered(t.address, ["r-mcore-fp8tw"])
    tstub = trainer_stub(channel(t.address), "", 300)
    rstub = rollout_stub(channel(r.address), "", 60)

    def sync(direction: str):
        rep = tstub.Sync(trainer_pb2.SyncRequest(transport="ipc", ipc_direction=direction)).report
        assert rep.ok, [x.error for x in rep.rollouts]
        assert ("stream.trainer_writes" in rep.phase_seconds) == (direction == "trainer_writes"), rep.phase_seconds
        st = rstub.GetStatus(rollout_pb2.GetStatusRequest())
        logits, version = _rollout_logits(r)
        assert version == rep.version and st.state == rollout_pb2.SERVING
        return logits, st.weights_checksum, rep

    for i in range(2):
        if i == 1:
            _load(t, _weights_dir(fleet.tmp, 13))
        read_logits, read_sum, _ = sync("rollout_reads")
        for _ in range(2):  # the first maps the table (quantized at prepare), the second defers the quantize
            logits, csum, rep = sync("trainer_writes")
            assert csum == read_sum and torch.equal(logits, read_logits), (i, rep.phase_seconds)
        print(f"megatron fp8 trainer_writes: {rep.seconds * 1e3:.1f} ms, {dict(rep.phase_seconds)}")
