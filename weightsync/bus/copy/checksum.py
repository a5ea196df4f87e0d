"""Bucket checksums that give the same value on CPU and GPU.

A sum of 32-bit words (and of their squares) accumulated in int64 with wrap-around is
independent of reduction order, so a bucket checksummed on a GPU by the sender and on a
CPU (or another GPU) by the receiver agrees bit for bit. It detects corruption and
truncation, not deliberate tampering or word reordering; authentication is the control
plane's job. Costs one read of the buffer; on CUDA a fused Triton kernel (checksum_triton.py),
which also comes as a copy that checksums what it copies (a rollout's copy-out, verified_copy.py).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

ALGO = "ws-sum64-v1"
_MASK = (1 << 64) - 1
_CHUNK_WORDS = 16 << 20
#: CPU: words per step (4 MiB: the square stays in the core's L2 cache; few steps, so few hand-overs
#: of the GIL, which each numpy call releases: many small steps are slow next to busy Python threads)
_CPU_CHUNK = 1 << 20
_SIGN = 1 << 63
_scratch = threading.local()  # per thread: the CPU squares' buffer (rollout and trainer threads sum at once)


def bucket_checksum(buf: torch.Tensor) -> int:
    """Checksum of a flat uint8 buffer; the length is mixed in so zero padding counts."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"checksum wants a flat uint8 buffer, got {buf.dtype} with shape {tuple(buf.shape)}")
    n = buf.numel()
    whole = n - n % 4
    words = buf[:whole].view(torch.int32)
    return from_sums(_word_sums(words), buf[whole:], n)


def from_sums(sums: torch.Tensor, tail: torch.Tensor, n: int) -> int:
    """The checksum of an `n`-byte buffer from its word sums (int64 [sum, sum of squares] over its
    n // 4 whole words, in any order) and its last n % 4 bytes."""
    s1, s2 = (int(v) for v in sums.tolist())  # the one host sync per bucket
    tail_bytes = bytes(tail.cpu().tolist()) if tail.numel() else b""  # no device round trip for none
    return _mix(s1, s2, tail_bytes, n)


def from_many_sums(sums: list[torch.Tensor] | torch.Tensor, tails: list[torch.Tensor], ns: list[int]) -> list[int]:
    """`from_sums` of many buffers with one device read for all their sums (and one for any tail
    bytes), where a loop would wait on the device once per buffer. `sums`: one [2] tensor per buffer,
    or all of them as the rows of one [buffers, 2] tensor (read as it is: no stacking kernel)."""
    if not (len(sums) == len(tails) == len(ns)):
        raise ValueError(f"from_many_sums: {len(sums)} sums, {len(tails)} tails and {len(ns)} sizes")
    if not len(sums):
        return []
    if isinstance(sums, torch.Tensor):
        pairs = sums.tolist()
    else:
        pairs = torch.stack([s.to(sums[0].device) for s in sums]).tolist()
    tail_bytes = []
    if any(t.numel() for t in tails):
        tail_bytes = torch.cat([t.to(tails[0].device) for t in tails]).cpu().tolist()
    out, pos = [], 0
    for (s1, s2), t, n in zip(pairs, tails, ns):
        k = t.numel()
        out.append(_mix(int(s1), int(s2), bytes(tail_bytes[pos : pos + k]), n))
        pos += k
    return out


def _mix(s1: int, s2: int, tail_bytes: bytes, n: int) -> int:
    t = int.from_bytes(tail_bytes, "little") if tail_bytes else 0
    return (s1 * 0x9E3779B97F4A7C15 + s2 * 0xC2B2AE3D27D4EB4F + t * 0x165667B19E3779F9 + n) & _MASK


def word_sums(words: torch.Tensor) -> torch.Tensor:
    """int64 [sum of words, sum of wrapped squares] of an int32 tensor, on its device."""
    return _word_sums(words)


def copy_word_sums(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy the int32 words `src` into `dst` and return their word sums, reading `src` once on CUDA
    (one fused Triton kernel: the copy and the checksum are one pass over the bytes)."""
    if src.shape != dst.shape or src.dtype != torch.int32 or dst.dtype != torch.int32:
        raise ValueError(
            f"copy_word_sums wants two int32 tensors of one shape, got {src.dtype} "
            f"{tuple(src.shape)} and {dst.dtype} {tuple(dst.shape)}"
        )
    if src.is_cuda and dst.is_cuda and src.numel():
        from weightsync.bus.copy import checksum_triton

        if checksum_triton.available():
            return checksum_triton.copy_word_sums(src, dst)
    if src.device.type == "cpu" and dst.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous():
        return _cpu_word_sums(src, dst)
    dst.copy_(src)
    return _word_sums(src)


def _word_sums(words: torch.Tensor) -> torch.Tensor:
    if words.is_cuda and words.numel():
        from weightsync.bus.copy import checksum_triton  # lazy: triton comes only with CUDA builds of torch

        if checksum_triton.available():
            return checksum_triton.word_sums(words)
    if words.device.type == "cpu" and words.is_contiguous():
        return _cpu_word_sums(words)
    acc = torch.zeros(2, dtype=torch.int64, device=words.device)
    # Squares wrap in int32 (deterministic on every device); sums accumulate in int64 without an
    # int64 copy of the data. Chunked so the one int32 temporary stays small next to the bucket.
    for chunk in words.split(_CHUNK_WORDS):
        acc[0] += torch.sum(chunk, dtype=torch.int64)
        acc[1] += torch.sum(chunk * chunk, dtype=torch.int64)
    return acc


def _cpu_word_sums(words: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
    """`_word_sums` of contiguous CPU int32 words (copied into `dst` on the way, if given), the same
    value. numpy, cache-sized steps: torch's int32 -> int64 sum is slow on the CPU and its square
    allocates the bucket's size again; numpy's widening sum and a reused square buffer read each word
    once from memory (measured several times faster on the CPU)."""
    if dst is not None:
        dst.copy_(words)
    a = words.numpy()
    sq = getattr(_scratch, "sq", None)
    if sq is None:
        sq = _scratch.sq = np.empty(_CPU_CHUNK, dtype=np.int32)
    s1 = s2 = 0
    for i in range(0, a.size, _CPU_CHUNK):
        c = a[i : i + _CPU_CHUNK]
        q = sq[: c.size]
        np.multiply(c, c, out=q)  # wraps in int32, as the GPU's squares do
        s1 += int(c.sum(dtype=np.int64))
        s2 += int(q.sum(dtype=np.int64))
    # int64 with wrap-around, as the torch accumulation
    return torch.tensor([(s1 + _SIGN) % (1 << 64) - _SIGN, (s2 + _SIGN) % (1 << 64) - _SIGN], dtype=torch.int64)


#: (device, ((address, words), ...)) -> the table of many_word_sums on that device; the actor's
#: in-place buckets keep their addresses from sync to sync, so this is built once per layout
_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_TABLES = 8


def _many_table(bufs: list[torch.Tensor], whole: list[int]) -> tuple[torch.Tensor, int] | None:
    """The GPU table of (address, word count) rows for `bufs` and the longest count; None where
    the one-launch kernel is not available (each buffer is then summed on its own)."""
    from weightsync.bus.copy import checksum_triton

    if not checksum_triton.available():
        return None
    rows = tuple((b.data_ptr(), w // 4) for b, w in zip(bufs, whole))
    if any(addr % 4 for addr, _ in rows):
        return None  # not word-aligned: the words cannot be read as int32 from there
    key = (bufs[0].device, rows)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        table = _TABLES[key] = torch.tensor(rows, dtype=torch.int64).to(bufs[0].device)
    return table, max(n for _, n in rows)


def _many_word_sums(rest: tuple[torch.Tensor, int] | None, bufs: list[torch.Tensor], whole: list[int]) -> torch.Tensor:
    """[len(bufs), 2] word sums: one launch from the table `rest`, or one per buffer without it."""
    if rest is not None:
        from weightsync.bus.copy import checksum_triton

        return checksum_triton.many_word_sums(*rest)
    return torch.stack([_whole_word_sums(b, w) for b, w in zip(bufs, whole)])


def _whole_word_sums(buf: torch.Tensor, whole: int) -> torch.Tensor:
    """The word sums of `buf`'s first `whole` bytes (a multiple of 4; zeros for none)."""
    if not whole:
        return torch.zeros(2, dtype=torch.int64, device=buf.device)
    return _word_sums(buf[:whole].view(torch.int32))


def _read_sums(buf: torch.Tensor, regions: list[tuple[int, int]], known: torch.Tensor) -> torch.Tensor:
    """`known` plus the word sums of `buf`'s words in byte ranges `regions`."""
    return region_word_sums(buf, regions) + known.to(buf.device)


def region_word_sums(buf: torch.Tensor, regions: list[tuple[int, int]]) -> torch.Tensor:
    """int64 [2]: the word sums of the words of `buf` (flat uint8) in byte ranges `regions`
    (word-aligned), on its device (queued on the current stream on a GPU: one launch)."""
    from weightsync.bus.copy.checksum_regions import region_table

    regions = [(s, e) for s, e in regions if e > s]
    table = region_table(buf, regions)
    if table is not None:
        from weightsync.bus.copy import checksum_triton

        whole = buf.numel() - buf.numel() % 4
        return checksum_triton.scatter_word_sums(buf[:whole].view(torch.int32), table)
    out = torch.zeros(2, dtype=torch.int64, device=buf.device)
    for s, e in regions:
        out += _word_sums(buf[s:e].view(torch.int32)).to(buf.device)
    return out


def combine(checksums: list[int]) -> int:
    """Order-dependent combination of bucket checksums into one weights checksum."""
    acc = 0xCBF29CE484222325
    for c in checksums:
        acc = ((acc ^ c) * 0x100000001B3) & _MASK
    return acc


def warm_up(device) -> float:
    """Compile and run the checksum for `device` now; seconds it took (0.0 off-GPU).

    On CUDA the first checksum JIT-compiles the Triton kernel (about a second, more on a cold
    cache), once per specialisation: the word count divisible by 16 or not. A service calls this
    at start-up, before it reports ready, so the first sync after a start does not pay it.
    """
    import time

    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    for nbytes in (64 << 10, (64 << 10) + 4, (64 << 10) + 6):  # word count % 16 == 0, != 0, and a tail
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        bucket_checksum(buf)
        words = buf[: nbytes - nbytes % 4].view(torch.int32)
        copy_word_sums(words, torch.empty_like(words))  # the rollout's copy-out kernels (verified_copy.py)
    from weightsync.bus.copy import checksum_triton

    if checksum_triton.available():
        words = torch.zeros(64, dtype=torch.int32, device=device)
        dst = torch.empty(32, dtype=torch.int32, device=device)
        checksum_triton.scatter_word_sums(
            words, checksum_triton.scatter_table([(0, 32, dst.data_ptr()), (32, 32, 0)], device)
        )
        table = torch.tensor([(words.data_ptr(), 64), (dst.data_ptr(), 32)], dtype=torch.int64).to(device)
        checksum_triton.many_word_sums(table, 64)  # the in-place buckets' one launch (InFlightChecksums)
        from weightsync.bus.copy import scatter_triton

        scatter_triton.warm_up(device)  # the trainer_writes copy's configured kernel (verified_copy.py)
    return time.perf_counter() - t0


class InFlightChecksums:
    """The checksums of flat buffers that stay unchanged while they are read (a sync's in-place
    buckets: the actor's own storage, held by the sync), all started at once.

    On CUDA the sums are queued on a side stream, after whatever the caller's stream has queued
    (the last optimizer step): the first buffer's alone (the one a rollout checks before it touches
    its engine, read with `value(0)` as soon as its kernel is done), then every other buffer's in
    one launch (a launch per buffer costs tens of microseconds of Python each, milliseconds for a
    large model). The GPU works on them while the control plane still prepares the rollouts;
    `values()` reads all with a single host sync. Off the GPU each is computed at construction (a
    CPU has nothing to overlap).
    """

    def __init__(self, bufs: list[torch.Tensor], known=None):
        """`known` (checksum_regions.KnownSums): the sums of some of each buffer's words, which the
        kernel that wrote them computed (the block-FP8 quantizer's slots); only the other words
        are read here."""
        for b in bufs:
            if b.dtype != torch.uint8 or b.dim() != 1:
                raise ValueError(f"checksum wants flat uint8 buffers, got {b.dtype} with shape {tuple(b.shape)}")
        self._n = [b.numel() for b in bufs]
        self._side = None
        whole = [n - n % 4 for n in self._n]
        reads = None
        if known is not None:
            from weightsync.bus.copy.checksum_regions import others

            if len(known.ranges) != len(bufs) or tuple(known.sums.shape) != (len(bufs), 2):
                raise ValueError(
                    f"known sums for {len(known.ranges)} buffers ({tuple(known.sums.shape)}), not the {len(bufs)} given"
                )
            reads = [others(r, w, f"buffer {i}") for i, (r, w) in enumerate(zip(known.ranges, whole))]
        if not bufs or not bufs[0].is_cuda:
            if reads is None:
                self._values: list[int | None] = [bucket_checksum(b) for b in bufs]
            else:
                self._values = [
                    from_sums(_read_sums(b, rd, known.sums[i]), b[w:], n)
                    for i, (b, rd, w, n) in enumerate(zip(bufs, reads, whole, self._n))
                ]
            return
        self._values = [None] * len(bufs)
        device = bufs[0].device
        self._tails = [b[w:] for b, w in zip(bufs, whole)]  # unchanged until the reader is done, like the words
        if reads is not None:
            self._start_known(bufs, reads, known.sums, device)
            return
        rest = _many_table(bufs[1:], whole[1:]) if len(bufs) > 1 else None  # (may copy to the GPU: not on the side)
        self._queue_on_side(
            device,
            lambda: _whole_word_sums(bufs[0], whole[0]),
            lambda: _many_word_sums(rest, bufs[1:], whole[1:]).unbind(0),
        )

    def _start_known(self, bufs, reads, known: torch.Tensor, device) -> None:
        """The GPU path with known sums: each buffer's other words, one launch each (first the first's)."""
        from weightsync.bus.copy.checksum_regions import region_table

        for b, rd in zip(bufs, reads):
            region_table(b, rd)  # (may copy to the GPU: not on the side)
        self._known = known  # read on the side stream: kept alive until this object goes
        self._queue_on_side(
            device,
            lambda: _read_sums(bufs[0], reads[0], known[0]),
            lambda: [_read_sums(b, rd, known[i]) for i, (b, rd) in enumerate(zip(bufs, reads)) if i],
        )

    def _queue_on_side(self, device, first, rest) -> None:
        """Queue, on a side stream after the caller's work so far (what wrote the buffers), `first()`
        (the first buffer's word sums) then `rest()` (the others'), each followed by an event: the
        first bucket's value waits for its own launch only."""
        self._side = side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._sums = [first()]
            self._events = [torch.cuda.Event()]
            self._events[0].record(side)
            if len(self._n) > 1:
                self._sums.extend(rest())
                self._events.append(torch.cuda.Event())
                self._events[1].record(side)

    def __len__(self) -> int:
        return len(self._n)

    def value(self, i: int) -> int:
        """Buffer i's checksum, waiting for its kernel only."""
        if self._values[i] is None:
            self._events[min(i, 1)].synchronize()
            self._values[i] = from_sums(self._sums[i], self._tails[i], self._n[i])
        return self._values[i]

    def values(self) -> list[int]:
        """Every buffer's checksum, with one wait and one read for all those not read yet."""
        todo = [i for i, v in enumerate(self._values) if v is None]
        if todo:
            self._events[-1].synchronize()  # kernels run in order on the side stream
            got = from_many_sums(
                [self._sums[i] for i in todo], [self._tails[i] for i in todo], [self._n[i] for i in todo]
            )
            for i, v in zip(todo, got):
                self._values[i] = v
        return list(self._values)

    def release(self) -> None:
        """Order what the caller's stream does next (an optimizer step writing the buffers) after
        the reads still queued, whether or not their values were read (a sync that failed early)."""
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
