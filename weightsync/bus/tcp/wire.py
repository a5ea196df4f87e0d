"""TCP transport: raw sockets, one connection per (sync, rollout), for CPU hosts and links NCCL can't cross.

Wire format (little-endian), after connecting to the rollout's data address:
  hello  : b"WSH2" | u16 len | sync_id utf-8 | u32 sender | 32-byte HMAC-SHA256(token, sync_id "\n" sender)
           (zeros without a token); sender is the trainer rank streaming on this connection: with
           several senders a rollout accepts one connection per sender, each proving the token for
           its own (sync, sender), so rank 0 hands the other senders their MACs, never the token
  bucket : b"WSB1" | u32 index | u64 nbytes | u64 checksum | u8 has_checksum | nbytes of payload
  delta  : b"WSD1" | u32 index | u64 nbytes | u64 checksum | u8 has_checksum | u64 length | length bytes of
           payload: the bucket as the words that changed since the rollout's copy of the delta base
           (weightsync/bus/delta/codec.py), sent to a rollout that accepted the base; length < nbytes, and the
           checksum is of the resulting dense bucket
The receiver checks every header against the manifest it accepted in PrepareSync, so a peer
cannot make it allocate or write more than the manifest declared.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync.bus.channel import BucketReceiver, BucketSender
from weightsync.bus.delta.payload import HEADER_BYTES, framed_size
from weightsync.bus.errors import CorruptFrame, TransportError
from weightsync.bus.plan import BucketPlan

HELLO_MAGIC = b"WSH2"
BUCKET_MAGIC = b"WSB1"
DELTA_MAGIC = b"WSD1"
_BUCKET_HDR = struct.Struct("<4sIQQB")
_DELTA_LEN = struct.Struct("<Q")
#: bytes per sendall of a payload: the unit of the per-target progress count (sent_bytes)
_PROGRESS_CHUNK = 16 << 20
_MAX_SYNC_ID = 256
_SOCK_BUF = 8 << 20


def hello_mac(token: str, sync_id: str, sender: int = 0) -> bytes:
    if not token:
        return bytes(32)
    return hmac.new(token.encode(), f"{sync_id}\n{sender}".encode(), hashlib.sha256).digest()


def hello_frame(sync_id: str, sender: int, mac: bytes) -> bytes:
    sid = sync_id.encode()
    return HELLO_MAGIC + struct.pack("<H", len(sid)) + sid + struct.pack("<I", sender) + mac


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view`; with a `deadline` (time.monotonic()) the whole read must end by then, however the
    peer spaces its bytes (a socket timeout alone bounds each recv, not their sum)."""
    got = 0
    n = len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"peer sent {got} of {n} bytes before the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError(f"peer closed the connection after {got} of {n} bytes")
        got += k


def read_hello(
    sock: socket.socket, deadline: float, magic: bytes | None = None, stage: Callable[[int], None] | None = None
) -> tuple[str, int, bytes]:
    """(sync_id, sender rank, MAC) of a connection's hello (`magic`: its first 4 bytes, if already read),
    all of it received by `deadline` (time.monotonic()). `stage(n)` is told before each part is read
    that it needs n bytes (the pre-auth budget's measure of progress)."""
    if magic is None:
        magic = recv_magic(sock, deadline)
    if magic != HELLO_MAGIC:
        raise TransportError(f"bad hello magic {magic!r}: not a weightsync bus peer")
    head = bytearray(2)
    if stage is not None:
        stage(len(head))
    _recv_exact(sock, memoryview(head), deadline)
    (n,) = struct.unpack("<H", head)
    if not 0 < n <= _MAX_SYNC_ID:
        raise TransportError(f"hello sync_id length {n} out of range")
    rest = bytearray(n + 4 + 32)
    if stage is not None:
        stage(len(rest))
    _recv_exact(sock, memoryview(rest), deadline)
    (sender,) = struct.unpack("<I", rest[n : n + 4])
    return rest[:n].decode("utf-8", errors="replace"), sender, bytes(rest[n + 4 :])


def recv_magic(sock: socket.socket, deadline: float) -> bytes:
    """A connection's first 4 bytes, by `deadline`: a bus hello's or the sync link's magic."""
    magic = bytearray(4)
    _recv_exact(sock, memoryview(magic), deadline)
    return bytes(magic)


def _tune(sock: socket.socket) -> None:
    # Best effort: larger kernel buffers and no Nagle delay; not every socket family has them.
    for level, opt, val in (
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF),
        (socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF),
    ):
        try:
            sock.setsockopt(level, opt, val)
        except OSError:
            pass


class TcpBucketReceiver(BucketReceiver):
    """Reads the buckets of one sync from an accepted, hello-verified connection.

    `base`: the rollout's copy of its committed buckets for this sync (rollout_svc/sync/delta_base.py),
    or None: `base.received(plan, dense)` keeps a dense bucket and `base.patched(plan, payload)` applies
    a delta frame onto the copy; each returns the resulting bucket. Without it a delta frame is refused."""

    def __init__(self, sock: socket.socket, base=None):
        _tune(sock)
        self.sock = sock
        self.base = base
        self._buf: torch.Tensor | None = None

    def recv(self, plan: BucketPlan, timeout: float) -> tuple[torch.Tensor, int | None]:
        self.sock.settimeout(timeout)
        hdr = bytearray(_BUCKET_HDR.size)
        try:
            _recv_exact(self.sock, memoryview(hdr))
        except (socket.timeout, OSError) as exc:
            raise TransportError(f"bucket {plan.index}: no header within {timeout:.0f}s ({exc})") from None
        magic, index, nbytes, csum, has_csum = _BUCKET_HDR.unpack(hdr)
        if magic not in (BUCKET_MAGIC, DELTA_MAGIC):
            raise TransportError(f"bucket {plan.index}: bad frame magic {magic!r}")
        if index != plan.index or nbytes != plan.nbytes:
            raise TransportError(
                f"frame says bucket {index} with {nbytes} bytes; manifest expects bucket "
                f"{plan.index} with {plan.nbytes} bytes"
            )
        size = nbytes
        if magic == DELTA_MAGIC:
            if self.base is None:
                raise TransportError(f"bucket {plan.index}: a delta frame in a sync this rollout takes in full")
            head = bytearray(_DELTA_LEN.size)
            self._read(plan, memoryview(head), timeout)
            (size,) = _DELTA_LEN.unpack(head)
            if not HEADER_BYTES <= size < nbytes:  # never more than the dense bucket: the manifest bounds it
                raise CorruptFrame(f"bucket {plan.index}: delta of {size} bytes for a {nbytes}-byte bucket")
        if self._buf is None or self._buf.numel() < size:
            self._buf = torch.empty(size, dtype=torch.uint8)
        view = self._buf[:size]
        raw = memoryview(view.numpy()).cast("B")
        if magic == DELTA_MAGIC:  # its header first: it must agree with the frame's length
            self._read(plan, raw[:HEADER_BYTES], timeout)
            expected = framed_size(bytes(raw[:HEADER_BYTES]), nbytes)
            if expected != size:
                raise CorruptFrame(
                    f"bucket {plan.index}: delta frame of {size} bytes, but its header describes {expected}"
                )
            raw = raw[HEADER_BYTES:]
        self._read(plan, raw, timeout)
        if magic == DELTA_MAGIC:
            view = self.base.patched(plan, view)
        elif self.base is not None:
            view = self.base.received(plan, view)
        return view, (csum if has_csum else None)

    def _read(self, plan: BucketPlan, view: memoryview, timeout: float) -> None:
        try:
            _recv_exact(self.sock, view)
        except (socket.timeout, OSError) as exc:
            raise TransportError(f"bucket {plan.index}: payload not received within {timeout:.0f}s ({exc})") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TcpBucketSender(BucketSender):
    """Streams each bucket to every target in parallel; a failing target is dropped, not fatal.

    Each bucket goes to every target at once (one pool thread each, all from the same bytes: no copy
    per target), and `send` returns once every target took it, so the pipeline can reuse its buffer.
    A target whose socket stopped draining (a stopped or hung rollout) therefore holds the others'
    next bucket until it is dropped: `drop(tid, why)` — from any thread, e.g. the stream's liveness
    watch — shuts its socket down, which wakes its blocked send, and the others go on at once.

    `sender`: the trainer rank this stream belongs to; `mac`: its hello MAC when the caller holds
    the MAC but not the token (a sender rank other than 0), else computed from `token`.
    `delta_targets`: the targets that accepted a delta base; `send(..., delta=payload)` sends them the
    delta frame, the others the dense bucket. `wire_bytes`: what went to each target, frames included."""

    def __init__(
        self,
        targets: dict[str, str],
        sync_id: str,
        token: str,
        timeout: float,
        *,
        sender: int = 0,
        mac: bytes | None = None,
    ):
        if not targets:
            raise ValueError("TcpBucketSender needs at least one target")
        self.timeout = timeout
        self._socks: dict[str, socket.socket] = {}
        self._failures: dict[str, str] = {}
        #: sockets dropped while a send may still use them: closed by close(), never under a sending thread
        self._dropped: list[socket.socket] = []
        self._lock = threading.Lock()
        self.delta_targets: set[str] = set()
        self.wire_bytes: dict[str, int] = {tid: 0 for tid in targets}
        #: payload bytes each target's kernel took so far, counted per chunk while a bucket goes out
        self.sent_bytes: dict[str, int] = {tid: 0 for tid in targets}
        self._pool = ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="tcp-send")
        hello = hello_frame(sync_id, sender, hello_mac(token, sync_id, sender) if mac is None else mac)
        for tid, fut in [(tid, self._pool.submit(self._connect, addr, hello)) for tid, addr in targets.items()]:
            try:
                self._socks[tid] = fut.result()
            except Exception as exc:  # recorded per target: the others still get the sync
                self._failures[tid] = f"cannot open the TCP bus to {targets[tid]}: {exc}"
        if not self._socks:
            self.close()
            raise TransportError("no rollout reachable on the TCP bus: " + "; ".join(self._failures.values()))

    def _connect(self, address: str, hello: bytes) -> socket.socket:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout)
        _tune(sock)
        sock.settimeout(self.timeout)
        sock.sendall(hello)
        return sock

    def _send_one(self, tid: str, sock: socket.socket, hdr: bytes, payload: memoryview) -> None:
        try:
            sock.sendall(hdr)
            # in chunks, each counted once the kernel took it: the stream's liveness watch reads the
            # count as receive progress (a stopped peer stops taking bytes once its buffers fill)
            for at in range(0, payload.nbytes, _PROGRESS_CHUNK):
                sock.sendall(payload[at : at + _PROGRESS_CHUNK])
                self.sent_bytes[tid] = self.sent_bytes.get(tid, 0) + min(_PROGRESS_CHUNK, payload.nbytes - at)
            self.wire_bytes[tid] += len(hdr) + payload.nbytes
        except OSError as exc:
            with self._lock:
                if self._socks.get(tid) is not sock:
                    return  # dropped (drop() recorded why): the closed socket is why this send failed
                self._failures[tid] = f"TCP bus send failed: {exc}"
                self._socks.pop(tid, None)
            sock.close()

    def drop(self, tid: str, why: str) -> bool:
        """Stop streaming to `tid` (from any thread): its socket is shut down, which ends a send blocked
        on it, and `failures()` reports `why`. False if it had already left the stream."""
        with self._lock:
            sock = self._socks.pop(tid, None)
            if sock is None:
                return False
            self._failures[tid] = why
            self._dropped.append(sock)
        try:
            sock.shutdown(socket.SHUT_RDWR)  # close() would not wake a thread blocked in sendall
        except OSError:
            pass
        return True

    def send(
        self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None, delta: torch.Tensor | None = None
    ) -> None:
        if buf.device.type != "cpu":
            buf = buf.cpu()
        payload = memoryview(buf[: plan.nbytes].numpy()).cast("B")
        hdr = _BUCKET_HDR.pack(BUCKET_MAGIC, plan.index, plan.nbytes, checksum or 0, checksum is not None)
        frames = {}
        if delta is not None and self.delta_targets:
            delta = delta.cpu()
            frames[True] = (
                _BUCKET_HDR.pack(DELTA_MAGIC, plan.index, plan.nbytes, checksum or 0, checksum is not None)
                + _DELTA_LEN.pack(delta.numel()),
                memoryview(delta.numpy()).cast("B"),
            )
        frames[False] = (hdr, payload)
        with self._lock:
            live = list(self._socks.items())
        sends = [(tid, s, *frames[delta is not None and tid in self.delta_targets]) for tid, s in live]
        for f in [self._pool.submit(self._send_one, *a) for a in sends]:
            f.result()
        if not self._socks:
            raise TransportError("every rollout dropped off the TCP bus: " + "; ".join(self._failures.values()))

    def failures(self) -> dict[str, str]:
        with self._lock:
            return dict(self._failures)

    def close(self) -> None:
        with self._lock:
            socks, self._dropped = list(self._socks.values()) + self._dropped, []
            self._socks.clear()
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
        self._pool.shutdown(wait=False)
