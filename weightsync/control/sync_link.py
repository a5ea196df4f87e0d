"""The sync link: a sync's PrepareSync, CommitSync and AbortSync on one long-lived TCP connection.

A gRPC unary call costs a new HTTP/2 stream, interceptors and a hand-off to the server's thread pool
and back; a sync makes two of them per rollout on its critical path. The same exchange as a frame on
an open socket measured an order of magnitude cheaper on loopback. The link carries
exactly those RPCs' messages and answers, so both ends run the same validation and handlers; gRPC
stays the path of record (registration, status, generation, the first prepare of a pairing) and
the fallback whenever the link cannot be used.

The rollout serves the link on its TCP data port (a connection whose first bytes are LINK_MAGIC
instead of a bus hello). Wire format, little-endian:

  trainer → rollout : LINK_MAGIC
  rollout → trainer : 16-byte random nonce
  trainer → rollout : 32-byte HMAC-SHA256(token, LINK_CONTEXT + nonce)   (a fresh nonce per
                      connection, so a recorded handshake cannot be replayed)
  rollout → trainer : b"\\x00" accepted (a refusal closes the connection)
  then, one at a time:
  request           : u8 method | u32 length | the RPC's request message
  answer            : u8 status (0 OK, else the grpc.StatusCode number) | u32 length |
                      the RPC's response message, or for an error its details in UTF-8

A trainer that opens with LINK_MAGIC_BEATS instead gets the same link plus a liveness signal: the
rollout sends an empty BEAT frame (status BEAT, length 0) as soon as it has read a request (its
acknowledgement), then one every BEAT_PERIOD_S while the request's handler runs, before its answer.
A rollout that is slow keeps beating; one that is gone (stopped, hung, its host away) falls silent,
and the trainer gives up on it after its `liveness_timeout_s` instead of the call's whole
`rpc_timeout_s` — or, in a sync, a short grace after the other rollouts answered when it never even
acknowledged (weightsync.publisher.straggler).

Between requests (while a sync streams its buckets on the bus) the trainer may send a PING frame
(kind PING, length 0): the rollout's link thread answers it with a BEAT at once, whatever its apply is
doing, so a rollout that is blocked (draining generation requests) still answers and one that is
stopped or hung does not (weightsync.publisher.stream_liveness). A rollout that predates PING answers
it with an UNIMPLEMENTED error frame, which is as good a sign of life.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from collections.abc import Callable

import grpc

from weightsync.bus.errors import TransportError
from weightsync.v1 import rollout_pb2

LINK_MAGIC = b"WSL1"
#: the same link, with BEAT frames while a request is handled
LINK_MAGIC_BEATS = b"WSL2"
#: the status byte of a BEAT frame (never a grpc.StatusCode number)
BEAT = 0xFF
#: the kind of a PING frame (trainer -> rollout, between requests): answered by a BEAT at once
PING = 0xFE
#: how often a rollout beats while it handles a request; a trainer's liveness_timeout_s must be
#: several of these (the config checks it)
BEAT_PERIOD_S = 0.25
LINK_CONTEXT = b"weightsync sync link v1\n"
NONCE_BYTES = 16
ACCEPTED = b"\x00"
_FRAME = struct.Struct("<BI")

#: method number on the wire -> (RPC name, request type, response type)
METHODS = {
    1: ("PrepareSync", rollout_pb2.PrepareSyncRequest, rollout_pb2.PrepareSyncResponse),
    2: ("CommitSync", rollout_pb2.CommitSyncRequest, rollout_pb2.CommitSyncResponse),
    3: ("AbortSync", rollout_pb2.AbortSyncRequest, rollout_pb2.AbortSyncResponse),
}
NUMBER_OF = {name: num for num, (name, _, _) in METHODS.items()}
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def link_mac(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), LINK_CONTEXT + nonce, hashlib.sha256).digest()


def status_code(number: int) -> grpc.StatusCode:
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def frame(kind: int, payload: bytes) -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


def whole_frames(data: bytes) -> tuple[int, int]:
    """(frames, bytes) of the complete frames at the start of `data` (a partial one is not counted)."""
    count = at = 0
    while len(data) - at >= _FRAME.size:
        _, n = _FRAME.unpack_from(data, at)
        if len(data) - at - _FRAME.size < n:
            break
        count, at = count + 1, at + _FRAME.size + n
    return count, at


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """n bytes, or TransportError (peer closed) / TimeoutError (past `deadline`, a time.monotonic())."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within the deadline ({got} of {n} bytes read)")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def read_frame(
    sock: socket.socket, deadline: float | None, limit_of: Callable[[int], int] | None = None
) -> tuple[int, bytes]:
    """(kind, payload) of the next frame. FrameTooLarge when the length is above `limit_of(kind)`;
    the payload is then left unread (the connection cannot be used further)."""
    kind, n = _FRAME.unpack(recv_exact(sock, _FRAME.size, deadline))
    limit = limit_of(kind) if limit_of is not None else None
    if limit is not None and n > limit:
        raise FrameTooLarge(kind, n, limit)
    return kind, recv_exact(sock, n, deadline) if n else b""


class FrameTooLarge(ValueError):
    def __init__(self, kind: int, size: int, limit: int):
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.kind, self.size, self.limit = kind, size, limit
