"""The sending pipeline: export → pack bucket k+1 while bucket k is on the wire.

A producer thread (kept across syncs) pulls tensors from the actor's export iterator and packs them into one of
`num_buffers` reusable flat buffers; the calling thread hands filled buffers to the channel.
With two buffers, gathering/packing overlaps sending, and extra memory stays at two buckets
plus whatever single tensor the exporter holds: a sync never materialises the whole model.

Two variations: a `BufferPool` keeps the buffers across syncs (CUDA IPC shares a buffer once and
the rollout keeps it mapped, so the buffers must outlive the sync), and `in_place` buckets —
flat storage in which the actor's own tensors already sit in the manifest's layout and dtype —
are sent as they are, with no export pass and no pack copy; their checksums are all started at
once (InFlightChecksums) and a sender that does not carry them with every bucket
(`checksums_in_band`) gets them at the end, for the commit, instead of waiting for each. In-place
buckets with no checksum to wait for go to a channel that takes them all at once (`send_held`: the
trainer writing into the engine queues one kernel per bucket for all of them) with no producer thread at all.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from weightsync.bus.channel import BucketSender
from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum
from weightsync.bus.pack import alloc_buffer, pack_bucket
from weightsync.bus.plan import Manifest
from weightsync.bus.workers import Workers


@dataclass
class StreamStats:
    checksums: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    #: time inside the actor's exporter (gather, rename, convert), a part of pack_seconds
    export_seconds: float = 0.0
    pack_seconds: float = 0.0
    send_seconds: float = 0.0
    wall_seconds: float = 0.0
    peak_buffer_bytes: int = 0
    #: bytes/s of the bucket that crossed the bus fastest (its bytes over the send wait its transfer ended
    #: in; 0: none measured). A receiver late to take a bucket lengthens that bucket's wait, never shortens
    #: one, so the fastest bucket is the link's own rate where the aggregate (bytes / send_seconds) would
    #: read a slow receiver as a slow link (publisher/delta_sync.py decides by it)
    link_rate: float = 0.0

    def bucket_waited(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.link_rate = max(self.link_rate, nbytes / seconds)


_DONE = object()
#: the producers' threads, kept across syncs (weightsync/bus/workers.py: none started per sync)
PRODUCERS = Workers("bus-pack")


def _zero_copy_candidate(plan, bucket_bytes: int) -> bool:
    return len(plan.slots) == 1 and plan.nbytes > bucket_bytes


def _own_bytes(plan, item, device: torch.device) -> torch.Tensor | None:
    """The bytes of an oversized tensor, in place when it already has the planned layout."""
    if item is None:
        return None
    name, t = item
    m = plan.slots[0].meta
    if name != m.name or tuple(t.shape) != m.shape or t.dtype != m.dtype:
        raise ValueError(
            f"bucket {plan.index}: exporter yielded {name} {tuple(t.shape)} {t.dtype}, "
            f"plan expects {m.name} {m.shape} {m.dtype}"
        )
    t = t.detach().to(device).contiguous()
    return t.reshape(-1).view(torch.uint8)


log = logging.getLogger(__name__)


class BufferPool:
    """Bucket buffers kept from one sync to the next; reallocated only when they no longer fit."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.allocations = 0

    def take(self, count: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        bufs = self.buffers
        if len(bufs) < count or any(b.numel() < nbytes or b.device != device for b in bufs[:count]):
            self.buffers = bufs = []  # dropped first, so old and new are never both held
            bufs.extend(alloc_buffer(nbytes, device) for _ in range(count))
            self.allocations += 1
        return bufs[:count]


def in_place_views(manifest: Manifest, in_place: list[torch.Tensor]) -> list[torch.Tensor]:
    if len(in_place) != len(manifest.buckets):
        raise ValueError(f"in_place has {len(in_place)} buffers for the manifest's {len(manifest.buckets)} buckets")
    views = []
    for plan, buf in zip(manifest.buckets, in_place):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < plan.nbytes:
            raise ValueError(
                f"in_place[{plan.index}]: need a flat uint8 buffer of at least {plan.nbytes} bytes, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )
        # a buffer of exactly the bucket's size is its own view (a slice per bucket per sync is a few
        # microseconds of dispatch each, on the fixed cost of every in-place sync)
        views.append(buf if buf.numel() == plan.nbytes else buf[: plan.nbytes])
    return views


def _timed(it: Iterator, stats: StreamStats) -> Iterator:
    """`it`, adding the time spent inside it to stats.export_seconds."""
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            stats.export_seconds += time.perf_counter() - t0
        yield item


@dataclass
class _Stream:
    """What the producer thread and the consumer of one stream share."""

    manifest: Manifest
    stats: StreamStats
    timeout: float
    deadline: float
    #: (plan, its reusable buffer or None, the bytes to send, checksum or None), _DONE, or the producer's error
    ready: queue.Queue = field(default_factory=queue.Queue)
    #: reusable buffers the producer may pack into
    free: queue.Queue = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"sync {self.manifest.sync_id}: streaming exceeded {self.timeout:.0f}s")
        return left


def stream_buckets(
    manifest: Manifest,
    tensors: Iterator[tuple[str, torch.Tensor]],
    sender: BucketSender,
    *,
    device: torch.device | str = "cpu",
    num_buffers: int = 2,
    with_checksums: bool = True,
    timeout: float = 600.0,
    buffers: BufferPool | None = None,
    in_place: list[torch.Tensor] | None = None,
    in_place_checksums: InFlightChecksums | None = None,
    on_sent: Callable[[int], None] | None = None,
    on_last_sent: Callable[[list[int]], None] | None = None,
) -> StreamStats:
    """Pack and send every bucket of `manifest`; raise on the first export or transport error.

    `buffers`: take the reusable buffers from this pool (kept after the sync) instead of
    allocating them. `in_place`: one flat buffer per bucket that already holds its bytes (the
    actor's own storage); `tensors` is then not read and nothing is packed.
    `in_place_checksums`: their checksums, started earlier (by default started here).
    `on_sent(nbytes)`: called after each bucket's send with the bucket's size (progress).
    `on_last_sent(checksums)`: called once the last bucket was handed to the sender, before a sender
    that `releases_previous` is flushed (its last transfers may still be on the wire), with every
    bucket's checksum: the caller can send its commit while they complete. Not called by a stream
    that fails first, nor for a sender that `computes_checksums` (its sums exist only after its flush).

    `sender.checksums_in_band` says which buckets' checksums it sends with the bucket: "all" (the
    default: tcp), "first" (CUDA IPC of held buffers: a rollout checks the first before it touches
    its engine, the rest at commit) or "none" (nccl); an in-place bucket whose checksum is not
    sent with it is not waited for. A sender that `computes_checksums` (it sums each bucket in its
    own pass, weightsync/bus/ipc/trainer_writes.py) gets no checksum from here: nothing is summed
    (`in_place_checksums` goes unread) and the stream's checksums are the sender's.
    """
    if num_buffers < 1:
        raise ValueError(f"num_buffers={num_buffers} must be >= 1")
    stats = StreamStats()
    if not manifest.buckets:
        return stats
    device = torch.device(device)
    st = _Stream(manifest, stats, timeout, time.monotonic() + timeout)
    views = in_place_views(manifest, in_place) if in_place is not None else None
    in_band = sender.checksums_in_band
    own_sums = getattr(sender, "computes_checksums", False)
    if own_sums:
        with_checksums, in_place_checksums = False, None
    if in_band not in ("all", "first", "none"):
        raise ValueError(f"sender.checksums_in_band={in_band!r} must be all, first or none")
    csums = None
    if views is None:
        _fill_free(st, device, num_buffers, buffers)
        produce = functools.partial(_produce_packed, st, tensors, device, with_checksums)
    else:
        if with_checksums:
            csums = in_place_checksums if in_place_checksums is not None else InFlightChecksums(views)
            if len(csums) != len(views):
                raise ValueError(f"in_place_checksums has {len(csums)} for the manifest's {len(views)} buckets")
        if csums is None and _sent_at_once(st, sender, views, on_sent):
            return stats
        if views[0].is_cuda:
            # Sent without a pack (whose synchronisation this stands for): the actor's writes are done.
            torch.cuda.current_stream(views[0].device).synchronize()
        produce = functools.partial(_produce_in_place, st, views, csums, in_band)
    t_start = time.perf_counter()
    producer = PRODUCERS.submit(functools.partial(_handing_errors_on, st, produce))
    try:
        _consume(st, sender, csums, on_sent, None if own_sums else on_last_sent)
    finally:
        st.stop.set()
        if csums is not None and in_place_checksums is None:  # a caller's own are the caller's to release
            csums.release()
        producer.join(timeout=30)
        if producer.is_alive():
            # Raising here would hide the error that got us here; the thread is a daemon (another takes the next).
            log.error("sync %s: packing thread still busy 30s after the stream ended", manifest.sync_id)
    stats.wall_seconds = time.perf_counter() - t_start
    return stats


def _sent_at_once(
    st: _Stream, sender: BucketSender, views: list[torch.Tensor], on_sent: Callable[[int], None] | None
) -> bool:
    """In-place buckets with no checksum to wait for, handed to a channel that takes them all at once
    (`send_held`): no producer thread, no per-bucket hand-over. False: the channel sends one by one."""
    stats, buckets = st.stats, st.manifest.buckets
    t0 = time.perf_counter()
    if not sender.send_held(list(buckets), views):
        return False
    for plan in buckets:
        stats.bytes_sent += plan.nbytes
        if on_sent is not None:
            on_sent(plan.nbytes)
    if sender.releases_previous:
        sender.flush()
    if getattr(sender, "computes_checksums", False):
        stats.checksums = sender.checksums()
    stats.send_seconds += time.perf_counter() - t0
    stats.wall_seconds = stats.send_seconds
    stats.bucket_waited(stats.bytes_sent, stats.send_seconds)  # one hand-over: no bucket of its own
    return True


def _fill_free(st: _Stream, device: torch.device, num_buffers: int, pool: BufferPool | None) -> None:
    """The reusable buffers packed buckets go through, into `st.free`."""
    manifest = st.manifest
    # A tensor larger than a bucket travels from its own memory (no copy), so the reusable
    # buffers only need to hold regular buckets: extra memory is num_buffers x bucket_bytes.
    packed = [b for b in manifest.buckets if not _zero_copy_candidate(b, manifest.bucket_bytes)]
    buf_bytes = max((b.nbytes for b in packed), default=0)
    n_bufs = min(num_buffers, len(packed))
    st.stats.peak_buffer_bytes = buf_bytes * n_bufs
    for buf in (
        pool.take(n_bufs, buf_bytes, device)
        if pool is not None and n_bufs
        else (alloc_buffer(buf_bytes, device) for _ in range(n_bufs))
    ):
        st.free.put(buf)


def _handing_errors_on(st: _Stream, produce) -> None:
    try:
        produce()
    except BaseException as exc:  # handed to the consumer, which re-raises it
        st.ready.put(exc)


def _produce_in_place(st: _Stream, views: list[torch.Tensor], csums: InFlightChecksums | None, in_band: str) -> None:
    """Producer of in-place buckets: each already holds its bytes; only its checksum may be waited for."""
    for k, (plan, view) in enumerate(zip(st.manifest.buckets, views)):
        if st.stop.is_set():
            return
        t0 = time.perf_counter()
        wanted = csums is not None and (in_band == "all" or (in_band == "first" and k == 0))
        csum = csums.value(k) if wanted else None
        st.stats.pack_seconds += time.perf_counter() - t0
        st.ready.put((plan, None, view, csum))
    st.ready.put(_DONE)


def _produce_packed(
    st: _Stream, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device, with_checksums: bool
) -> None:
    """Producer of packed buckets: the exporter's tensors packed into the free buffers (an
    oversized tensor is sent from its own memory)."""
    manifest, stats = st.manifest, st.stats
    it = _timed(iter(tensors), stats)
    for plan in manifest.buckets:
        if _zero_copy_candidate(plan, manifest.bucket_bytes):
            t0 = time.perf_counter()
            view = _own_bytes(plan, next(it, None), device)
            if view is None:
                raise ValueError(f"bucket {plan.index}: exporter did not yield {plan.slots[0].meta.name} as planned")
            buf = None
        else:
            buf = _take_free(st)
            if buf is None:
                return
            t0 = time.perf_counter()
            view = pack_bucket(plan, itertools.islice(it, len(plan.slots)), buf)
            if view.device.type == "cuda":
                torch.cuda.current_stream(view.device).synchronize()
        csum = bucket_checksum(view) if with_checksums else None
        stats.pack_seconds += time.perf_counter() - t0
        st.ready.put((plan, buf, view, csum))
    leftover = next(it, None)
    if leftover is not None:
        raise ValueError(f"exporter yielded {leftover[0]} beyond the manifest's {manifest.num_tensors} tensors")
    st.ready.put(_DONE)


def _take_free(st: _Stream) -> torch.Tensor | None:
    """A free buffer once the consumer has sent what it held; None when the stream stopped."""
    while not st.stop.is_set():
        try:
            return st.free.get(timeout=min(1.0, st.remaining()))
        except queue.Empty:
            pass
    return None


def _consume(
    st: _Stream,
    sender: BucketSender,
    csums: InFlightChecksums | None,
    on_sent: Callable[[int], None] | None = None,
    on_last_sent: Callable[[list[int]], None] | None = None,
) -> None:
    """Hand each produced bucket to `sender` in order, giving its buffer back once reusable."""
    stats, manifest = st.stats, st.manifest
    releases_previous = sender.releases_previous
    held = None  # with a releases_previous sender, bucket k's buffer is reusable only after send(k+1)
    # a releases_previous sender's send(k) waits for bucket k-1's transfer (flush for the last one's)
    waited_for = 0
    while True:
        try:
            item = st.ready.get(timeout=st.remaining())
        except queue.Empty:
            raise TimeoutError(f"sync {manifest.sync_id}: exporter produced nothing within {st.timeout:.0f}s") from None
        if item is _DONE:
            break
        if isinstance(item, BaseException):
            raise item
        plan, buf, view, csum = item
        t0 = time.perf_counter()
        sender.send(plan, view, csum)
        waited = time.perf_counter() - t0
        stats.send_seconds += waited
        stats.bucket_waited(waited_for if releases_previous else plan.nbytes, waited)
        waited_for = plan.nbytes
        stats.bytes_sent += plan.nbytes
        if on_sent is not None:
            on_sent(plan.nbytes)
        if csum is not None and csums is None:
            stats.checksums.append(csum)
        if releases_previous:
            if held is not None:
                st.free.put(held)
            held = buf
        elif buf is not None:
            st.free.put(buf)
    if on_last_sent is not None:
        # the commit goes out while the last transfers complete (the receiver checks every bucket
        # before it commits): the in-place sums are read now, not after the flush
        _read_sums(stats, csums)
        on_last_sent(list(stats.checksums))
    if releases_previous:  # the others' sends returned with their buckets delivered
        t0 = time.perf_counter()
        sender.flush()
        waited = time.perf_counter() - t0
        stats.send_seconds += waited
        stats.bucket_waited(waited_for, waited)
    if csums is not None and on_last_sent is None:
        _read_sums(stats, csums)
    elif getattr(sender, "computes_checksums", False):
        stats.checksums = sender.checksums()


def _read_sums(stats: StreamStats, csums: InFlightChecksums | None) -> None:
    """The in-place buckets' checksums into `stats` (the packed ones are there already)."""
    if csums is not None:
        t0 = time.perf_counter()
        stats.checksums = csums.values()
        stats.pack_seconds += time.perf_counter() - t0
