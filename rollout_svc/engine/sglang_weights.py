"""How weights get into an SGLang engine: three paths, each onto one of SGLang's own update APIs.

SGLang runs one scheduler subprocess per TP rank; the model lives there, not in rollout-svc's
process. So "load these tensors" always means handing SGLang something it can reach:

1. Tensors in our process (TCP bus on a GPU host, staged sync) — `load_weights` / `load_bucket`.
   A CUDA bucket buffer goes over as ONE flattened bucket: `update_weights_from_tensor(
   load_format="flattened_bucket")` with a per-rank payload {"flattened_tensor": <uint8 CUDA
   tensor, pickled as a CUDA IPC handle>, "metadata": [FlattenedTensorMetadata ...]}. SGLang
   slices tensors out by `start_idx:end_idx`, so our 256-byte-aligned plan offsets are used as
   they are: no repacking, no copy on our side. CPU tensors go as a plain named list (shared
   memory file descriptors), which SGLang moves to each rank's GPU.

2. Colocated (trainer and rollout on the same GPUs) — `load_ipc_bucket`. The trainer's
   `CudaIpcHandle` (bus.proto) is forwarded to SGLang's schedulers *without opening it here*:
   we emit exactly the pickle torch's `reduce_tensor` would have produced
   (`torch.multiprocessing.reductions.rebuild_cuda_tensor` + its 15 arguments, device given as
   the GPU UUID, which `sglang.srt.utils.patch_torch` maps back to an index). SGLang's
   SafeUnpickler allow-lists that function and `FlattenedTensorMetadata` (checked by the
   contract test). Between rollouts the trainer gets the memory back through
   `release_memory_occupation` / `resume_memory_occupation` (needs `enable_memory_saver`).

3. Distributed (SGLang's own NCCL group) — `join_update_group` + `receive_bucket_distributed`.
   SGLang's ranks join a torch process group and receive the broadcast themselves:
   `update_weights_from_distributed(names, dtypes, shapes, load_format="flattened_bucket")`
   makes every rank allocate ONE dense uint8 tensor and run ONE `broadcast(src=0)` per call,
   then load the tensors sliced out of it. That is a bucket-level path (one collective per
   bucket, not per tensor) and exists in 0.5.10 and 0.5.23 (in 0.5.10 via
   `FlattenedTensorBucket(named_tensors=...)`, in 0.5.23 via `FlattenedTensorBucket.empty`).
   Two constraints follow from SGLang's receive code and are checked here before any collective:
     * the layout is dense: tensor i starts where tensor i-1 ends, no alignment padding, so the
       trainer must broadcast a buffer packed without our 256-byte alignment (plan with align=1);
     * every tensor starts at a multiple of its element size (0.5.23 raises otherwise).

   The rendezvous mismatch. Our NCCL transport ships an ncclUniqueId over gRPC. SGLang cannot
   take one: `init_weights_update_group(master_address, master_port, rank_offset, world_size,
   group_name, backend)` calls `sglang.srt.utils.init_custom_process_group(init_method=
   "tcp://host:port", rank=rank_offset + tp_rank, world_size, group_name)`, i.e. torch's
   `rendezvous()` -> a `TCPStore` client, wrapped in `PrefixStore(group_name, store)`, then
   `_new_process_group_helper(...)` builds a ProcessGroupNCCL on that store. NCCL's unique id
   is exchanged through that store by rank 0. So the trainer must *serve* the rendezvous:
     - trainer = rank 0 of a group of world_size = 1 + sum(tp_size of every SGLang rollout in
       the group); rollout r gets rank_offset = 1 + sum of the tp sizes before it;
     - the trainer hosts the store and builds its group with the SAME recipe as rank 0:
       `rendezvous("tcp://addr:port", rank=0, world_size)` (a master `TCPStore`),
       `PrefixStore(group_name, store)` with the same group_name it sends to the rollout, then
       torch's `_new_process_group_helper(world_size, 0, [], backend, store, group_name=...)`.
       A hand-built `ProcessGroupNCCL(PrefixStore(group_name, TCPStore(...)))` does NOT work:
       the helper nests "<group>/" and "<device>/" prefixes, so the keys differ (found by the
       gloo test). No default process group is needed on the trainer;
     - the store's master blocks until all world_size clients connect and SGLang's call blocks
       until the group forms: the trainer must start its side in a thread BEFORE it asks the
       rollouts (over gRPC) to join, then wait for both;
     - each sync: for each bucket, the trainer broadcasts the dense uint8 buffer with
       `dist.broadcast(buf, src=0, group=pg)` while the rollout calls
       `receive_bucket_distributed(plan)` (which blocks in SGLang until its broadcast completes);
     - the group lives across syncs while group_name is unchanged (like NcclTransport.group_id);
       `leave_update_group` destroys SGLang's side.
   `serve_rendezvous` below is a reference implementation of the trainer side.

Nothing here imports sglang at module import time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.bus.plan import ALIGN, BucketPlan, Slot

log = logging.getLogger(__name__)


class SglangUpdateError(RuntimeError):
    """SGLang refused or failed a weight update; the sync must abort (weights may be mixed)."""


def _dtype_name(dtype: torch.dtype) -> str:
    # SGLang resolves dtype strings with getattr(torch, name).
    return str(dtype).removeprefix("torch.")


def check_result(res: Any, what: str) -> None:
    """Update calls return (success, message); flush_cache a FlushCacheReqOutput; memory calls None."""
    ok, msg = True, ""
    if isinstance(res, (tuple, list)) and res and isinstance(res[0], bool):
        ok, msg = res[0], (res[1] if len(res) > 1 else "")
    elif hasattr(res, "success"):
        ok, msg = bool(res.success), str(getattr(res, "message", ""))
    if not ok:
        raise SglangUpdateError(f"sglang {what} failed: {msg}")


def dense_layout_error(plan: BucketPlan) -> str | None:
    """Why SGLang's distributed flattened-bucket receive would misread `plan`, or None if it fits."""
    end = 0
    for slot in plan.slots:
        m = slot.meta
        if slot.offset != end:
            return (
                f"bucket {plan.index}: tensor {m.name} starts at byte {slot.offset} but SGLang's "
                f"flattened bucket packs densely (expects {end}); the trainer must plan buckets for "
                "SGLang distributed receivers without alignment padding (align=1)"
            )
        if end % m.dtype.itemsize:
            return (
                f"bucket {plan.index}: tensor {m.name} ({m.dtype}) would start at byte {end}, not a multiple "
                f"of {m.dtype.itemsize}; SGLang 0.5.23's FlattenedTensorBucket.empty rejects it; order tensors "
                f"so each is aligned"
            )
        end += m.nbytes
    if plan.nbytes != end:
        return f"bucket {plan.index}: plan.nbytes={plan.nbytes} but its tensors add up to {end}"
    return None


@dataclass(frozen=True)
class UpdateGroup:
    """What a rollout needs to join SGLang's weight-update group (all of it travels over gRPC)."""

    master_address: str
    master_port: int
    rank_offset: int  # this rollout's first rank; the trainer is rank 0
    world_size: int  # 1 + every SGLang TP rank in the group
    group_name: str
    backend: str = "nccl"


#: torch's refusal to re-share a CUDA storage imported from another process (StorageSharing.cpp)
RESHARE_REFUSED = "CUDA tensor received from another process"


class _IpcTensor:
    """A CUDA tensor that exists only as the trainer's IPC handle; pickles to `rebuild_cuda_tensor`.

    Unpickled inside SGLang's scheduler it becomes a uint8 view of the trainer's bucket buffer.
    The argument order is torch's `rebuild_cuda_tensor` (15 arguments, device at index 6; the
    contract test checks both the local torch signature and SGLang's `_REDUCE_TENSOR_ARG_DEVICE_INDEX`).
    The trainer must fill `CudaIpcHandle.device_uuid` as `str(torch.cuda.get_device_properties(d).uuid)`,
    the form SGLang's patched rebuild compares.
    """

    def __init__(self, handle: Any, nbytes: int, device: str | int | None = None):
        self.handle = handle
        self.nbytes = nbytes
        #: where SGLang's worker opens it (a GPU's UUID; sglang_peer.py); None: the handle's own GPU
        self.device = device

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        h = self.handle
        device = self.device if self.device is not None else (h.device_uuid or int(h.device))
        args = (
            torch.Tensor,
            (self.nbytes,),
            (1,),
            0,
            torch.UntypedStorage,
            torch.uint8,
            device,
            bytes(h.handle),
            int(h.storage_size),
            int(h.storage_offset),
            False,
            bytes(h.ref_counter_handle),
            int(h.ref_counter_offset),
            bytes(h.event_handle),
            bool(h.event_sync_required),
        )
        return rebuild_cuda_tensor, args


class SglangWeightsMixin:
    """Weight paths of SglangEngine. Expects `self._sgl` (sglang Engine), `self.tp_size`, and
    `self._call(fn, **kw)`, which calls SGLang (its coroutine runs on SGLang's loop thread, sglang_loop.py); a
    sync runs only while no request is pinned (the engine gate), so these never overlap generation."""

    _sgl: Any
    tp_size: int
    _call: Any
    _update_group: str = ""  # the SGLang weight-update group joined, "" for none
    load_bucket_summed: Any  # sglang_direct.SglangDirectMixin

    # ---- path 1: tensors held by rollout-svc --------------------------------------------
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Engine.load_weights (staged commit, or any caller holding tensors). Sent in chunks of about
        LOAD_CHUNK_BYTES so neither a whole-model flat copy nor one fd per tensor of a whole model
        is ever needed at once."""
        for chunk in _chunks(named, LOAD_CHUNK_BYTES):
            if chunk[0][1].is_cuda:
                self._send_flattened(self.chunk_payloads(chunk))
            else:
                res = self._call(self._sgl.update_weights_from_tensor, named_tensors=chunk, flush_cache=False)
                check_result(res, "update_weights_from_tensor")

    def load_bucket(self, plan: BucketPlan, buf: torch.Tensor) -> None:
        """Load one received bucket; a CUDA buffer is handed over whole, at the plan's offsets."""
        if not buf.is_cuda:
            from weightsync.bus.pack import unpack_bucket

            self.load_weights(unpack_bucket(plan, buf))
            return
        if self.load_bucket_summed(plan, buf) is not None:  # our loader in SGLang's workers (sglang_direct.py)
            return
        self._send_flattened(self.bucket_payloads(plan, buf))

    # The payload builders are separate from the sends so tests/sglang_exec can hand SGLang's own
    # receive code exactly these bytes (built from a CPU buffer there).
    def chunk_payloads(self, chunk: list[tuple[str, torch.Tensor]]) -> list[bytes]:
        """One flat uint8 buffer per chunk: SGLang does one IPC open and one slice pass for it.

        Offsets are aligned as in a bucket plan: SGLang views each slice as its dtype, which
        fails for a tensor starting at a byte offset that is not a multiple of its element
        size (an odd-length bf16 tensor followed by an fp32 one; found by tests/sglang_exec).
        """
        slots, off = [], 0
        for name, t in chunk:
            off = -(-off // ALIGN) * ALIGN
            slots.append((name, tuple(t.shape), t.dtype, off, off + t.numel() * t.element_size()))
            off = slots[-1][4]
        flat = torch.zeros(off, dtype=torch.uint8, device=chunk[0][1].device)
        for (_, t), (_, _, _, a, b) in zip(chunk, slots):
            flat[a:b].copy_(t.detach().reshape(-1).view(torch.uint8))
        return [self._payload(flat, slots)] * self.tp_size

    def bucket_payloads(self, plan: BucketPlan, buf: torch.Tensor) -> list[bytes]:
        """The received bucket whole, at the plan's (aligned) offsets; one payload per TP rank."""
        slots = [_slot_row(s) for s in plan.slots]
        flat = buf[: plan.nbytes]
        try:
            payload = self._payload(flat, slots)
        except RuntimeError as exc:
            if RESHARE_REFUSED not in str(exc):
                raise
            # A bucket that rollout-svc mapped from the trainer's CUDA IPC handle (colocated ipc
            # transport) cannot be re-shared: torch refuses to export a storage it imported. Copy it
            # into a buffer of this process (kept for the next bucket: update_weights_from_tensor
            # returns once SGLang has loaded it). Found on an H100 (bench/sglang_live.py).
            payload = self._payload(self._staging_copy(flat), slots)
        return [payload] * self.tp_size

    def _staging_copy(self, flat: torch.Tensor) -> torch.Tensor:
        stage = getattr(self, "_stage", None)
        if stage is None or stage.numel() < flat.numel() or stage.device != flat.device:
            stage = self._stage = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
        out = stage[: flat.numel()]
        out.copy_(flat)
        return out

    # ---- path 2: colocated, trainer's CUDA IPC handle -----------------------------------
    def load_ipc_bucket(self, plan: BucketPlan, handles: list[Any]) -> None:
        """Load a bucket that lives in the trainer's memory; `handles[r]` is TP rank r's copy.

        One handle for every rank is allowed (ranks then read over NVLink from that GPU).
        """
        if len(handles) not in (1, self.tp_size):
            raise ValueError(f"bucket {plan.index}: {len(handles)} IPC handles for {self.tp_size} SGLang TP ranks")
        slots = [_slot_row(s) for s in plan.slots]
        per_rank = handles if len(handles) == self.tp_size else handles * self.tp_size
        self._send_flattened([self._payload(_IpcTensor(h, plan.nbytes), slots) for h in per_rank])

    def _payload(self, flat: Any, slots: list[tuple]) -> bytes:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        # Real CUDA tensors then pickle with the device UUID, as SGLang's schedulers expect.
        _patch_reductions()
        metadata = [
            FlattenedTensorMetadata(name=n, shape=torch.Size(shape), dtype=dt, start_idx=a, end_idx=b, numel=b - a)
            for n, shape, dt, a, b in slots
        ]
        return MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata})

    def _send_flattened(self, payloads: list[bytes]) -> None:
        res = self._call(
            self._sgl.update_weights_from_tensor,
            named_tensors=payloads,
            load_format="flattened_bucket",
            flush_cache=False,
        )
        check_result(res, "update_weights_from_tensor(flattened_bucket)")

    # ---- path 3: SGLang receives the NCCL broadcast itself ------------------------------
    def join_update_group(self, group: UpdateGroup) -> None:
        """Blocks until the trainer (rank 0) and every other member have joined."""
        res = self._call(
            self._sgl.init_weights_update_group,
            master_address=group.master_address,
            master_port=group.master_port,
            rank_offset=group.rank_offset,
            world_size=group.world_size,
            group_name=group.group_name,
            backend=group.backend,
        )
        check_result(res, f"init_weights_update_group({group.group_name})")
        self._update_group = group.group_name

    def leave_update_group(self) -> None:
        name = self._update_group
        if name:
            self._update_group = ""
            check_result(
                self._call(self._sgl.destroy_weights_update_group, group_name=name),
                f"destroy_weights_update_group({name})",
            )

    def receive_bucket_distributed(self, plan: BucketPlan) -> None:
        """Receive bucket `plan` by SGLang's own broadcast (one collective) and load it.

        Returns when every SGLang rank has loaded it. The bytes never pass through this process,
        so there is no buffer to checksum here (see docs/sglang.md).
        """
        group = self._update_group
        if not group:
            raise SglangUpdateError("receive_bucket_distributed before join_update_group")
        why = dense_layout_error(plan)
        if why:
            raise ValueError(why)
        metas = [s.meta for s in plan.slots]
        res = self._call(
            self._sgl.update_weights_from_distributed,
            names=[m.name for m in metas],
            dtypes=[_dtype_name(m.dtype) for m in metas],
            shapes=[list(m.shape) for m in metas],
            group_name=group,
            flush_cache=False,
            load_format="flattened_bucket",
        )
        check_result(res, f"update_weights_from_distributed(bucket {plan.index})")

    # ---- colocated: share the GPU with the trainer --------------------------------------
    #: memory tags released and not yet resumed, in SGLang's own order (an instance's own set once used)
    _released: tuple[str, ...] = ()

    def release_memory(self, tags: list[str] | None = None) -> tuple[str, ...]:
        """Free SGLang's GPU memory for training (None: every tag not released yet); returns the tags now
        released. The weights' contents are lost (no CPU backup): only a complete sync serves again.

        SGLang asserts its scheduler is idle: the transaction calls this under the engine gate, no request pinned.
        """
        want = [t for t in (_tags(tags) or _MEMORY_TAGS) if t not in self._released]
        if want:
            t0 = time.perf_counter()
            res = self._call(self._sgl.release_memory_occupation, tags=want)
            check_result(res, "release_memory_occupation")
            self._released = tuple(t for t in _MEMORY_TAGS if t in self._released or t in want)
            log.warning("sglang released %s in %.1f ms", want, (time.perf_counter() - t0) * 1e3)
        return self._released

    def released_memory(self) -> tuple[str, ...]:
        return self._released

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Map released memory again (None: every released tag); a tag not released is skipped (SGLang's
        scheduler raises on a resume of a tag it holds). Colocated sync order (sglang_engine.begin_apply /
        end_apply): resume(["weights"]) -> the buckets -> resume() the rest (KV cache, CUDA graphs), so the
        KV cache is not resident while the trainer's buckets still are."""
        want = [t for t in (_tags(tags) or _MEMORY_TAGS) if t in self._released]
        if not want:
            return
        t0 = time.perf_counter()
        check_result(self._call(self._sgl.resume_memory_occupation, tags=want), "resume_memory_occupation")
        self._released = tuple(t for t in self._released if t not in want)
        self._add_ms("resume_" + "+".join(want), (time.perf_counter() - t0) * 1e3)


def _patch_reductions() -> None:
    """SGLang's `monkey_patch_torch_reductions`, except that CPU tensors keep torch's reducer.

    SGLang's patched reducer rewrites argument 6 (the device) of whatever torch's reducer
    returns; for a CPU tensor that is `rebuild_tensor`'s 3-tuple, so every later pickle of a CPU
    tensor in this process raises IndexError (sglang 0.5.10 and 0.5.23, found by tests/sglang_exec).
    rollout-svc's process also hosts SGLang's Engine, whose named-tensor update path
    (`load_weights` with CPU tensors) pickles CPU tensors: without this, the first CUDA bucket
    would break every later CPU load.
    """
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    monkey_patch_torch_reductions()
    patched = reductions.reduce_tensor
    original = getattr(reductions, "_reduce_tensor_original", None)
    if original is None or getattr(patched, "cpu_keeps_torch_reducer", False):
        return

    def reduce_tensor(tensor, *args, **kwargs):
        return (patched if tensor.is_cuda else original)(tensor, *args, **kwargs)

    reduce_tensor.cpu_keeps_torch_reducer = True
    reductions.reduce_tensor = reduce_tensor
    reductions.init_reductions()


_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang.srt.constants GPU_MEMORY_TYPE_*


def _tags(tags: list[str] | None) -> list[str] | None:
    for t in tags or ():
        if t not in _MEMORY_TAGS:
            raise ValueError(f"memory tag {t!r} is not one of {_MEMORY_TAGS}")
    return list(tags) if tags else None


LOAD_CHUNK_BYTES = 1 << 30


def _chunks(named: Iterable[tuple[str, torch.Tensor]], limit: int):
    """Consecutive runs of tensors on one device, each up to `limit` bytes (a bigger tensor goes alone)."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and (size + n > limit or t.device != cur[0][1].device):
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def _slot_row(s: Slot) -> tuple:
    m = s.meta
    return m.name, m.shape, m.dtype, s.offset, s.offset + m.nbytes


def serve_rendezvous(group: UpdateGroup, timeout_s: float = 600.0):
    """Trainer side (rank 0) of SGLang's weight-update group; returns the process group.

    Reference implementation for trainer-svc (which should own it once wired). It must build
    the group exactly as SGLang's `init_custom_process_group` does for ranks >= 1, because torch's
    `_new_process_group_helper` nests further store prefixes ("<group>/", then "<device>/")
    under SGLang's `PrefixStore(group_name, ...)`; a hand-built TCPStore + ProcessGroupNCCL
    would wait on different keys and time out (tests/unit/rollout_svc/engine/sglang checks this on gloo
    against SGLang's own function). Trainer and SGLang should run the same torch minor so the
    c10d key layout agrees. The group is registered by name in torch's c10d registry; the
    default process group is neither needed nor touched.
    Blocks until all `world_size` members joined: call it in a thread before telling rollouts to
    `join_update_group`.
    """
    import datetime

    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{group.master_address}:{group.master_port}"
    store, _, _ = next(c10d.rendezvous(url, 0, group.world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group.group_name, store)
    torch_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    opts_kw = {"backend_options" if torch_minor >= (2, 6) else "pg_options": None}
    pg, _ = c10d._new_process_group_helper(
        group.world_size,
        0,
        [],
        c10d.Backend(group.backend),
        store,
        group_name=group.group_name,
        timeout=timeout,
        **opts_kw,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(group.world_size)}
    return pg
