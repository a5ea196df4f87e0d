"""The trainer's end of CUDA IPC, for rollouts on the trainer's own GPU (colocated).

The trainer names its GPU by UUID in PrepareSync; a rollout whose engine is on another GPU (or
host) refuses, and the trainer double-checks the UUID the rollout answers with. Buckets are
then handed over as CUDA IPC handles on one IpcBuckets stream per target and sync: the rollout
copies each bucket out of the mapped buffer and acknowledges it on the stream, and that
acknowledgement is what lets the pipeline reuse the buffer. The buffers — the pipeline's, kept
in a BufferPool, or the actor's own parameter storage when it already is the export — live as
long as the trainer and are shared once (HandleCache); the rollout maps each once and keeps it.

The other direction (trainer_writes.py): a single target in inplace apply mode whose engine offers
its parameters answers PrepareSync with a destination table, and the trainer writes every bucket
into the engine itself, checksumming in the same pass (`ipc_direction`, default auto).
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Iterator

import grpc
import torch

from weightsync.bus.channel import BucketSender
from weightsync.bus.errors import TransportError
from weightsync.bus.gpu import uuid_of as gpu_uuid
from weightsync.bus.session import RpcCall, Sender, Session, kind_of
from weightsync.v1 import bus_pb2, rollout_pb2


def describe(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    return f"{code.name if code else 'UNKNOWN'}: {exc.details() if hasattr(exc, 'details') else exc}"


#: (rollout entry, RPC name, request iterator, timeout) -> the grpc stream call (iterated for the
#: responses; cancel() and add_done_callback() used as grpc defines them)
StreamCall = Callable[[object, str, Iterator, float], Iterator]
_END = None
_END_WAIT_S = 2.0


class _TargetStream:
    """One rollout's IpcBuckets call: requests go in through a queue, acknowledgements come back in order."""

    def __init__(self, entry, open_stream: StreamCall, timeout: float):
        self._q: queue.Queue = queue.Queue()
        self.responses = open_stream(entry, "IpcBuckets", iter(self._q.get, _END), timeout)

    def put(self, request) -> None:
        self._q.put(request)

    def end(self) -> None:
        self._q.put(_END)  # also releases grpc's thread that reads the requests

    def cancel(self) -> None:
        self.end()
        self.responses.cancel()

    def wait_ended(self, timeout: float) -> None:
        """Until the rollout has ended its side (at most `timeout`)."""
        ended = threading.Event()
        self.responses.add_done_callback(lambda _call: ended.set())  # runs at once if the call already ended
        ended.wait(timeout)


class IpcStreamSender(BucketSender):
    """Sends each bucket's handle to every target on one IpcBuckets stream per target.

    `send(k)` queues bucket k on every stream and returns once every live target has
    acknowledged bucket k-1 (releases_previous): the rollout is already copying bucket k while
    the pipeline refills k-1's buffer. A target whose stream fails is dropped, not fatal.

    `held` buffers (the actor's own storage, unchanged until the sync ends) are never refilled, so
    their handles go out without waiting for any acknowledgement (all of them are awaited at
    `flush`), and only the first carries its checksum: a rollout checks that one before it
    touches its engine and every other at commit, where the trainer sends them all.
    """

    releases_previous = True

    def __init__(
        self,
        targets: dict,
        sync_id: str,
        open_stream: StreamCall,
        cache,
        reusable: Callable[[torch.Tensor], bool],
        timeout: float,
        held: bool = False,
    ):
        if not targets:
            raise ValueError("IpcStreamSender needs at least one target")
        # held: the buffers are the actor's own storage, unchanged until the sync ends, so a rollout
        # may acknowledge a bucket once its copy is queued (PushBucketRequest.held_until_commit)
        self.sync_id, self.cache, self.reusable, self.held = sync_id, cache, reusable, held
        self.checksums_in_band = "first" if held else "all"
        self._failures: dict[str, str] = {}
        self._live: dict[str, _TargetStream] = {}
        for rid, entry in targets.items():
            try:
                self._live[rid] = _TargetStream(entry, open_stream, timeout)
            except grpc.RpcError as exc:
                self._failures[rid] = f"IpcBuckets: {describe(exc)}"
        self._unacked: list[tuple[int, torch.Tensor]] = []  # (bucket index, memory its handle names)
        self._commit_here: set[str] = set()  # targets whose stream stays open for the commit
        self._commit_elsewhere: set[str] = set()  # targets whose stream's end is not awaited by flush

    def commit_on_stream(self, rollout_ids) -> None:
        """These targets take the commit on their stream (PrepareSyncResponse.commit_on_stream):
        `flush` leaves their streams open and `commit` ends them."""
        self._commit_here = set(rollout_ids) & set(self._live)

    def commit_elsewhere(self, rollout_ids) -> None:
        """These targets commit over another path (the sync link) once `flush` returns: flush ends
        their streams without waiting for the rollout's end (a round trip), which `close` awaits.
        Every bucket is acknowledged before flush returns, so the commit follows all of them."""
        self._commit_elsewhere = set(rollout_ids) & set(self._live)

    def send(self, plan, buf: torch.Tensor, checksum: int | None) -> None:
        if buf.device.type == "cuda":
            # The rollout reads the buffer through another CUDA context: every write must be done.
            torch.cuda.current_stream(buf.device).synchronize()
        handle, keep = self.cache.handle(buf, self.reusable(buf))
        req = rollout_pb2.PushBucketRequest(
            sync_id=self.sync_id, index=plan.index, ipc=handle, checksum=checksum or 0, held_until_commit=self.held
        )
        for st in self._live.values():
            st.put(req)
        self._unacked.append((plan.index, keep))
        if len(self._unacked) > 1 and not self.held:
            self._await(self._unacked[-2][0])
        if not self._live:
            raise TransportError("every rollout dropped off the IPC bus: " + "; ".join(self._failures.values()))

    def flush(self) -> None:
        """Wait for the last acknowledgement, then end every stream."""
        if self._unacked:
            self._await(self._unacked[-1][0])
        for rid, st in list(self._live.items()):
            if rid in self._commit_here:
                continue
            st.end()
            if rid in self._commit_elsewhere:
                continue
            try:
                extra = next(st.responses, None)  # the rollout ends its side once ours has ended
            except grpc.RpcError as exc:
                extra = None
                self._drop(rid, f"IpcBuckets ended with {describe(exc)}")
            if extra is not None:
                self._drop(rid, f"IpcBuckets: unexpected acknowledgement of bucket {extra.index} after the last")
        if not self._live:
            raise TransportError("every rollout dropped off the IPC bus: " + "; ".join(self._failures.values()))

    def commit(
        self, rid: str, request: rollout_pb2.CommitSyncRequest, timeout: float | None = None
    ) -> tuple[rollout_pb2.CommitSyncResponse | None, str]:
        """Commit on `rid`'s stream after `flush`: (answer, "") or (None, error), as a CommitSync call.

        Safe to call for different targets from different threads (each reads its own stream).
        Bounded by `timeout` (the trainer's rpc_timeout_s, as a CommitSync call is: the stream is
        cancelled when it passes) and in any case by the stream's deadline, set when it was opened."""
        st = self._live.get(rid)
        if st is None or rid not in self._commit_here:
            return None, self._failures.get(rid, f"no IpcBuckets stream open to {rid} for the commit")
        expired = threading.Event()

        def expire():
            expired.set()
            st.cancel()

        timer = threading.Timer(timeout, expire) if timeout else None
        st.put(rollout_pb2.PushBucketRequest(sync_id=request.sync_id, commit=request))
        st.end()  # the commit is the stream's last message
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            answer = next(st.responses, None)
            if answer is None or not answer.HasField("commit"):
                return None, "IpcBuckets ended without answering the commit"
            next(st.responses, None)  # the rollout's end of the stream (it ends right after the answer)
        except grpc.RpcError as exc:
            if expired.is_set():
                return None, f"DEADLINE_EXCEEDED: IpcBuckets: the commit was not answered within {timeout:.1f}s"
            return None, describe(exc)
        finally:
            if timer is not None:
                timer.cancel()
        return answer.commit, ""

    def _await(self, index: int) -> None:
        """Every live target's acknowledgements up to bucket `index` (in order: streams keep it)."""
        owed = [i for i, _ in self._unacked if i <= index]
        for rid, st in list(self._live.items()):
            for expected in owed:
                try:
                    ack = next(st.responses)
                except StopIteration:
                    self._drop(rid, f"IpcBuckets ended before acknowledging bucket {expected}")
                    break
                except grpc.RpcError as exc:
                    self._drop(rid, f"IpcBuckets, bucket {expected}: {describe(exc)}")
                    break
                if ack.index != expected:
                    self._drop(rid, f"IpcBuckets: acknowledgement of bucket {ack.index}, expected {expected}")
                    break
        # acknowledged (or failed) by every target: the memory up to `index` may be reused
        self._unacked = [(i, t) for i, t in self._unacked if i > index]

    def _drop(self, rid: str, err: str) -> None:
        self._failures[rid] = err
        self._live.pop(rid).cancel()

    def failures(self) -> dict[str, str]:
        return dict(self._failures)

    def close(self) -> None:
        for rid in self._commit_elsewhere & set(self._live):
            # ended by flush; the rollout ends its side right after (it ended long before, unless
            # it misbehaves): cancelling earlier would cut off a handler still finishing
            self._live[rid].wait_ended(_END_WAIT_S)
        for st in self._live.values():
            st.cancel()
        self._live.clear()
        self._unacked.clear()


class IpcSender(Sender):
    """The trainer's CUDA IPC end, kept for the trainer's lifetime.

    It owns what must outlive a sync for the rollouts to keep their mappings: the pipeline's
    bucket buffers (a BufferPool) and their handles (a HandleCache), each shared once.
    """

    name = "ipc"

    def __init__(
        self,
        device: torch.device,
        call: RpcCall,
        uuid_of: Callable[[torch.device], str] = gpu_uuid,
        needs_cuda: bool = True,
        stream: StreamCall | None = None,
        cache=None,
        direction: str = "auto",
        open_fn: Callable | None = None,
    ):
        from weightsync.bus.ipc.trainer_writes import DIRECTIONS
        from weightsync.bus.pipeline import BufferPool

        if direction not in DIRECTIONS:
            raise ValueError(f"ipc_direction={direction!r} must be {', '.join(DIRECTIONS)}")
        self.direction = direction
        #: rollout_id -> (table id, its Destinations: validated and mapped) of the rollouts that offered one
        self.dests: dict[str, tuple[str, object]] = {}
        if open_fn is None:
            from weightsync.bus.ipc.handles import open_mapping as open_fn
        self.open_fn = open_fn
        self.device = torch.device(device)
        self.call, self.uuid_of, self.needs_cuda, self.stream = call, uuid_of, needs_cuda, stream
        self.buffers = BufferPool()
        if cache is None:
            from weightsync.bus.ipc.handles import HandleCache

            cache = HandleCache()
        self.cache = cache
        self.in_place: list[torch.Tensor] = []  # the actor's own bucket storage, when it sends from there

    @classmethod
    def for_trainer(cls, side) -> "IpcSender":
        return cls(side.device, side.call, stream=side.open_stream, **side.options.get(cls.name, {}))

    def long_lived(self, buf: torch.Tensor) -> bool:
        """Whether `buf` lies in memory kept across syncs (shared once), not in a one-off tensor."""
        ptr = buf.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for b in (*self.buffers.buffers, *self.in_place))

    def begin(self, targets: list, sync_id: str, bucket_bytes: int, direction: str = "") -> "_IpcSession":
        """This sync's session; `direction`: its ipc_direction ("" = the configured one)."""
        if self.needs_cuda and self.device.type != "cuda":
            raise ValueError(
                f"transport=ipc needs the trainer's export on the rollouts' GPU, and this trainer exports "
                f"on {self.device}: run it on that GPU (backend hf: --device cuda:N) or use --transport tcp"
            )
        ids = {getattr(t, "rollout_id", None) for t in targets}
        for rid in [r for r in self.dests if r not in ids]:
            del self.dests[rid]  # a rollout no longer synced: its engine's memory is unmapped
        from weightsync.bus.ipc.trainer_writes import DIRECTIONS

        if direction and direction not in DIRECTIONS:
            raise ValueError(f"ipc_direction={direction!r} must be {', '.join(DIRECTIONS)}")
        return _IpcSession(self, self.uuid_of(self.device), sync_id, bucket_bytes, len(targets), direction)


class _IpcSession(Session):
    name = "ipc"
    commit_on_stream = True  # on the IpcBuckets stream that carried the buckets

    def __init__(
        self, owner: IpcSender, uuid: str, sync_id: str, bucket_bytes: int, n_targets: int = 1, direction: str = ""
    ):
        self.owner, self.uuid, self.sync_id, self.bucket_bytes = owner, uuid, sync_id, bucket_bytes
        #: the ipc_direction this sync asks for (the trainer's, unless the Sync call named one)
        self.asked = direction or owner.direction
        self.device = owner.device
        self.buffers = owner.buffers  # the pipeline packs into these, kept across syncs
        self.in_place = False  # this sync sends the actor's own storage, no reused buffer
        self.n_targets = n_targets
        self.manifest = None
        #: rollout_id -> the Destinations this sync writes into (trainer_writes), set at accept
        self.writes: dict = {}
        #: a quantized manifest's writer (trainer_writes.QuantizedWrites, `use_quantized_writes`): without
        #: one such a sync never asks the rollout for a table
        self.quantized_writes = None
        # the one target offered a table last time: it most likely does again (the sums wait for it)
        self._had_table = len(owner.dests) == 1

    @property
    def expects_channel_sums(self) -> bool:
        """Before prepare: whether this sync will most likely write into the engine (its target offered
        a table last time, and the trainer can write this manifest), which then sums as it writes."""
        return self._had_table and self._can_write()

    @property
    def direction(self) -> str:
        """What this sync runs: trainer_writes once its target's table was accepted, else rollout_reads."""
        return "trainer_writes" if self.writes else "rollout_reads"

    def use_manifest(self, manifest) -> None:
        self.manifest = manifest

    def use_quantized_writes(self, writes) -> None:
        """How this sync's quantized manifest is written into an engine (trainer_writes.QuantizedWrites,
        from weightsync.formats, which the bus cannot import): its destination dtypes and its stream."""
        self.quantized_writes = writes

    def _can_write(self) -> bool:
        """Whether the trainer can write this sync into an engine at all (a quantized one needs its writer)."""
        quantized = self.manifest is not None and self.manifest.quantization is not None
        return (
            self.asked != "rollout_reads"
            and self.n_targets == 1
            and (not quantized or self.quantized_writes is not None)
        )

    def use_in_place(self, buffers: list[torch.Tensor]) -> None:
        """The pipeline sends the actor's own bucket storage this sync (long-lived: shared once;
        unchanged until the sync ends, as the sync holds the actor)."""
        self.owner.in_place = list(buffers)
        self.in_place = True

    def spec_for(self, entry) -> bus_pb2.TransportSpec:
        spec = bus_pb2.TransportSpec()
        spec.ipc.host_id, spec.ipc.device_uuid = socket.gethostname(), self.uuid
        if self._can_write():
            spec.ipc.trainer_writes = True
            spec.ipc.writes_dequantized = self.manifest is not None and self.manifest.quantization is not None
            held = self.owner.dests.get(getattr(entry, "rollout_id", ""))
            spec.ipc.dest_layout = held[0] if held else ""
        return spec

    def accept(self, entry, resp) -> str:
        if kind_of(resp) != "ipc":
            return f"rollout answered an ipc prepare with transport {kind_of(resp)}"
        theirs = resp.transport.ipc.device_uuid
        if theirs != self.uuid:
            return (
                f"ipc: the rollout's engine is on GPU {theirs or '(not named)'}, the trainer on {self.uuid}; "
                "CUDA IPC needs both on one GPU: colocate them or use --transport nccl"
            )
        return self._accept_destinations(entry, resp.transport.ipc)

    def _accept_destinations(self, entry, ipc: bus_pb2.IpcTransport) -> str:
        """Take the rollout's destination table when this sync writes into its engine: "" or why the
        target cannot be synced (a table that does not match the manifest is an error, never a
        silent fallback)."""
        from weightsync.bus.ipc.trainer_writes import Destinations, choose

        rid = getattr(entry, "rollout_id", "")
        offered = bool(ipc.dest_layout) and self._can_write()
        direction = choose(self.asked, self.n_targets, offered)
        if direction != "trainer_writes":
            if self.asked == "trainer_writes" and self.n_targets == 1:
                return (
                    "ipc_direction=trainer_writes: the rollout offers no destination table (it must run "
                    "apply_mode inplace with an engine that offers its parameters: the built-in engine, which "
                    "takes block-FP8 weights dequantized, or SGLang with tp_size 1, no enable_memory_saver, 16-bit "
                    "weights, from its second sync of a layout on; not staged, one sender): set "
                    "ipc_direction auto or rollout_reads"
                )
            return ""
        held = self.owner.dests.get(rid)
        if ipc.HasField("destinations") and ipc.destinations.tensors:
            if self.manifest is None:
                return "ipc: a destination table arrived before the sync's manifest was planned"
            self.owner.dests.pop(rid, None)  # the old mapping goes before the new one is opened
            try:
                allowed = None
                if self.manifest.quantization is not None:
                    allowed = self.quantized_writes.destination_dtypes(self.manifest)
                dests = Destinations(self.manifest, ipc.destinations, self.owner.open_fn, allowed)
            except ValueError as exc:  # DestinationError, or a manifest the writer cannot pair
                return f"ipc trainer_writes: the rollout's destination table is refused: {exc}"
            held = self.owner.dests[rid] = (ipc.dest_layout, dests)
        elif held is None or held[0] != ipc.dest_layout:
            return f"ipc trainer_writes: the rollout named table {ipc.dest_layout!r}, which this trainer does not hold"
        elif self.manifest is not None and held[1].digest != self.manifest.layout_digest:
            return "ipc trainer_writes: the rollout's table was made for another layout"
        elif self.manifest is not None and held[1].logical != (self.manifest.quantization is not None):
            return "ipc trainer_writes: the rollout's table was made for another quantization"
        self.writes[rid] = held[1]
        return ""

    def open(self, targets: dict, timeout: float) -> IpcStreamSender:
        writing = [rid for rid in targets if rid in self.writes]
        if writing and len(targets) == 1:
            from weightsync.bus.ipc.trainer_writes import TrainerWriteSender

            self.commit_on_stream = False  # no stream: the commit goes on the sync link or as CommitSync
            if self.manifest is not None and self.manifest.quantization is not None:
                return self.quantized_writes.sender(self.writes[writing[0]], writing[0], self.manifest)
            return TrainerWriteSender(self.writes[writing[0]], writing[0])
        if self.owner.stream is None:
            raise ValueError("transport=ipc: this trainer has no IpcBuckets stream opener (SyncOrchestrator gives one)")
        return IpcStreamSender(
            targets,
            self.sync_id,
            self.owner.stream,
            self.owner.cache,
            self.owner.long_lived,
            timeout,
            held=self.in_place,
        )

    def finish(self, ok: bool, reason: str) -> None:
        # handles of buffers no longer in use (a pool that reallocated, a re-laid-out actor) go
        self.owner.cache.retain([*self.owner.buffers.buffers, *self.owner.in_place])
