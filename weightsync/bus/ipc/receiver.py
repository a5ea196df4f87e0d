"""The rollout's end of CUDA IPC: check the trainer's GPU at prepare, consume pushed handles in place.

PrepareSync names the trainer's GPU by UUID; this rollout takes part only if its engine is on
that GPU. The buckets then arrive on one IpcBuckets stream per sync, each a CUDA IPC handle of a
trainer buffer: mapped once per pairing, consumed by the sync transaction while mapped (no extra
copy), and acknowledged once the engine has copied it out, which lets the trainer reuse it — or,
for a buffer the trainer holds unchanged until the sync ends (its own parameters), as soon as the
copy is queued, the checksum being read at commit.

Or the trainer writes (trainer_writes.py): asked by a trainer that can, a rollout in inplace apply
mode whose engine offers its parameters answers with a table of where each manifest tensor lives
(made and shared once per layout and engine, then named by id), pauses generation before it
answers, and receives no bucket: the commit carries the checksums of what the trainer wrote.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator

import torch

from weightsync.bus.errors import SyncError
from weightsync.bus.gpu import require_cuda, uuid_of
from weightsync.bus.ipc.handles import consuming
from weightsync.bus.rollout_end import RolloutEnd
from weightsync.v1 import bus_pb2, rollout_pb2


def check_ipc(
    spec: bus_pb2.IpcTransport,
    device: torch.device | None,
    engine_name: str,
    uuid_of: Callable[[torch.device], str] = uuid_of,
) -> str:
    """This engine's GPU UUID if it is the trainer's GPU (`spec.device_uuid`); otherwise SyncError."""
    dev = require_cuda(device, "ipc", engine_name)
    if not spec.device_uuid:
        raise SyncError(
            "transport.ipc.device_uuid is empty: the trainer must name the GPU its buffers live on", "INVALID_ARGUMENT"
        )
    own = uuid_of(dev)
    if own != spec.device_uuid:
        raise SyncError(
            f"transport ipc: the trainer's buffers are on GPU {spec.device_uuid}, this rollout's engine "
            f"is on {own} ({dev}); CUDA IPC needs both on one GPU: colocate them or use --transport nccl",
            "FAILED_PRECONDITION",
        )
    return own


class IpcReceiver(RolloutEnd):
    """Remembers which sync was prepared for CUDA IPC (and on which GPU) and feeds its buckets.

    Buckets come on one IpcBuckets stream per sync (or, one at a time, as PushBucket calls). Each
    names a buffer of the trainer's by handle; the buffer is mapped once per pairing and kept
    (MappedBuffers), and the engine copies the bucket out of it on a side stream: the
    acknowledgement waits for that stream's event only, never for the whole device.
    """

    name = "ipc"

    def __init__(
        self, tx, device: torch.device | None, engine_name: str, maps=None, on_open: Callable[[], None] | None = None
    ):
        self.tx, self.device, self.engine_name = tx, device, engine_name
        self._sync: tuple[str, str] = ("", "")  # (sync_id, GPU UUID) of the sync prepared for CUDA IPC
        if maps is None:
            from weightsync.bus.ipc.handles import MappedBuffers

            maps = MappedBuffers(on_open=on_open)
        self.maps = maps
        self._side: torch.cuda.Stream | None = None
        #: (layout digest, engine) -> (table id, IpcDestinations) or None when the engine offers none
        self._offers: dict[tuple, tuple[str, bus_pb2.IpcDestinations] | None] = {}
        self._writes = ""  # the sync whose prepare answered with a table (the trainer writes it)
        self.share_fn = None  # tests: stands in for CUDA IPC sharing

    @classmethod
    def for_rollout(cls, side) -> "IpcReceiver":
        """`side.options["ipc"]`: `on_open` (counts mappings opened)."""
        return cls(side.tx, side.device, side.engine_name, **side.options.get(cls.name, {}))

    def prepare(self, spec: bus_pb2.TransportSpec, manifest, resp) -> None:
        resp.transport.ipc.host_id, resp.transport.ipc.device_uuid = socket.gethostname(), self.check(spec.ipc)
        self._writes = ""
        if not spec.ipc.trainer_writes:
            return
        if manifest.quantization is not None and not spec.ipc.writes_dequantized:
            return  # a trainer that cannot take the engine's own tensors for a quantized manifest
        got = self.destinations(manifest)
        if got is None:
            return  # the trainer shares its buffers and this rollout copies, as without the request
        table_id, table = got
        resp.transport.ipc.dest_layout = table_id
        if spec.ipc.dest_layout != table_id:  # the trainer does not hold this table yet
            resp.transport.ipc.destinations.CopyFrom(table)
        self._writes = manifest.sync_id

    def receive(self, manifest, spec, deadline: float, resp) -> None:
        self.start(manifest.sync_id, resp.transport.ipc.device_uuid, manifest.origin)
        if self._writes == manifest.sync_id:
            # generation paused before the answer lets the trainer write (SyncError: nothing offered)
            self.tx.accept_trainer_writes(manifest.sync_id)
            dev = torch.device(self.device) if self.device is not None else None
            if dev is not None and dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()  # nothing of ours still reads the parameters

    def destinations(self, manifest) -> tuple[str, bus_pb2.IpcDestinations] | None:
        """(table id, table) of where `manifest`'s tensors go in the engine, or None when this rollout
        cannot take writes: staged apply, a multi-sender sync, a quantized one its engine does not
        take dequantized (`tx.write_metas`: SGLang loading FP8 pairs), an engine that does not offer
        its parameters or not on this GPU. Built and shared once per layout and engine. A
        block-FP8 manifest's table covers the tensors as the engine holds them: each FP8 weight its
        parameter (its dtype and shape), no scale (the trainer writes the weights dequantized)."""
        tx = self.tx
        if getattr(tx, "apply_mode", "") != "inplace":
            return None
        if len(manifest.senders) > 1 or not manifest.layout_digest:
            return None
        engine = tx.engine
        if getattr(engine, "exports_destinations", False):
            # an engine whose parameters live in another process (SGLang's TP worker) hands a table made and
            # shared there, or None (not learnt yet, or never: rollout_svc/engine/sglang_export.py); it keeps
            # its own tables, each with a fresh token
            if manifest.quantization is not None:
                return None
            return engine.ipc_destinations(manifest)
        key = (manifest.layout_digest, id(engine))
        if key in self._offers:
            return self._offers[key]
        from weightsync.bus.ipc.trainer_writes import DestinationError, layout_id, offer, slot_metas

        wanted = slot_metas(manifest)
        if manifest.quantization is not None:
            write_metas = getattr(tx, "write_metas", None)
            wanted = write_metas(manifest) if write_metas is not None else None
        params = engine.writable_params([m for m in wanted if m is not None]) if wanted is not None else None
        got = None
        dev = torch.device(self.device) if self.device is not None else None
        share = self.share_fn  # (CPU tests stand in for CUDA IPC sharing)
        if share is None and (dev is None or dev.type != "cuda"):
            params = None
        if params is not None and all(p.device == dev and p.data_ptr() % 4 == 0 and p.is_contiguous() for p in params):
            if share is None:
                from weightsync.bus.ipc.handles import share
            try:
                # a fresh token per table: a restarted rollout (or a rebuilt engine) whose parameters
                # land at the same addresses must not be taken for the one the trainer mapped
                got = (f"{layout_id(manifest, params)}-{uuid.uuid4().hex[:16]}", offer(manifest, params, share, wanted))
            except DestinationError:
                got = None
        if len(self._offers) >= 4:  # layouts change rarely
            self._offers.clear()
        self._offers[key] = got
        return got

    def check(self, spec: bus_pb2.IpcTransport) -> str:
        """PrepareSync: this engine's GPU UUID, or SyncError when it is not the trainer's GPU."""
        return check_ipc(spec, self.device, self.engine_name)

    def start(self, sync_id: str, gpu: str, origin: str = "") -> None:
        """The sync is prepared: accept its buckets (replacing any earlier IPC sync).

        `origin` names the trainer run: the mappings of another one are dropped now."""
        self._sync = (sync_id, gpu)
        self.maps.begin(origin)

    def push(self, request: rollout_pb2.PushBucketRequest) -> None:
        """Consume one bucket of the prepared sync; SyncError for anything it cannot be."""
        manifest = self.tx.pending_manifest(request.sync_id)
        if manifest is None:
            raise SyncError(f"sync {request.sync_id} is not prepared here")
        if not request.HasField("ipc"):
            raise SyncError("PushBucket carries CUDA IPC handles only; use the TCP bus for bytes", "INVALID_ARGUMENT")
        if request.index >= len(manifest.buckets):
            raise SyncError(
                f"index={request.index}: the manifest has {len(manifest.buckets)} buckets", "INVALID_ARGUMENT"
            )
        ipc_sync, gpu = self._sync
        if ipc_sync != request.sync_id or request.ipc.device_uuid != gpu:
            raise SyncError(
                f"ipc.device_uuid={request.ipc.device_uuid!r}: sync {request.sync_id} was not prepared "
                f"for CUDA IPC on this engine's GPU ({gpu if ipc_sync == request.sync_id else 'not an ipc sync'})",
                "INVALID_ARGUMENT",
            )
        buf = self.maps.get(request.ipc, manifest.buckets[request.index].nbytes)
        # A buffer the trainer leaves alone until the sync ends need not be copied out before the
        # acknowledgement: the copy is queued and its checksum read at commit (consume_bucket).
        held = request.held_until_commit
        if buf.device.type != "cuda":  # (CPU tests stand in for the mapping)
            with consuming(buf, request.ipc):
                self.tx.consume_bucket(request.sync_id, request.index, buf, request.checksum or None, defer_check=held)
            return
        side = self._side_stream(buf.device)
        # after whatever this process queued on its stream (generation used the weights there)
        side.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(side), consuming(buf, request.ipc):
            deferred = self.tx.consume_bucket(
                request.sync_id, request.index, buf, request.checksum or None, defer_check=held
            )
            done = torch.cuda.Event()
            done.record(side)
        if not deferred:
            # the bucket is out of the trainer's buffer (it may be overwritten), and in the engine
            # or the staging copy before anything else reads them; a deferred bucket's copy is
            # waited for at commit, with its checksum
            done.synchronize()

    def stream(self, requests) -> Iterator[rollout_pb2.PushBucketResponse]:
        """IpcBuckets: consume each bucket of one sync in turn and acknowledge it once copied out."""
        sync_id = None
        for request in requests:
            if sync_id is None:
                sync_id = request.sync_id
            elif request.sync_id != sync_id:
                raise SyncError(
                    f"sync_id={request.sync_id!r}: this IpcBuckets stream carries sync {sync_id}", "INVALID_ARGUMENT"
                )
            self.push(request)
            yield rollout_pb2.PushBucketResponse(index=request.index)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._side is None or self._side.device != device:
            self._side = torch.cuda.Stream(device)
        return self._side
