"""Progress of a long `wsctl sync` on stderr: the sync's phase and bytes as they happen.

The Sync call blocks until the sync ends; while it waits, wsctl polls GetSyncProgress (cheap: the
trainer asks no rollout anything) and shows where the sync stands. On a terminal that is one line,
rewritten in place and cleared at the end; otherwise (a log, a CI job) plain lines: one per phase,
and during a long stream one at most every PLAIN_EVERY_S. stdout keeps only the report, so
`--json` output and scripts that parse it are unchanged (wsctl shows no progress in `--json` mode).
"""

from __future__ import annotations

import threading
import time
from typing import TextIO

import grpc

from weightsync.v1 import trainer_pb2

#: how often the trainer is asked
POLL_S = 0.2
#: without a terminal, a new line for more bytes at most this often (a new phase always gets one)
PLAIN_EVERY_S = 1.0


def describe(p: trainer_pb2.SyncProgress) -> str:
    """One line: `sync v12 v12-ab12: stream 45.2/120.0 MB (38%), 3 rollout(s), 1.4s`."""
    head = f"sync v{p.version} {p.sync_id}" if p.sync_id else "sync"
    what = p.phase
    if p.bytes and p.phase in ("stream", "commit"):
        what += f" {p.bytes_sent / 1e6:.1f}/{p.bytes / 1e6:.1f} MB ({100 * p.bytes_sent / p.bytes:.0f}%)"
    return f"{head}: {what}, {p.num_rollouts} rollout(s) over {p.transport or '?'}, {p.seconds:.1f}s"


class ProgressLine:
    """Shows successive SyncProgress on `out`: a single updating line on a terminal, else plain lines."""

    def __init__(self, out: TextIO):
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self._shown = False
        self._last: tuple[str, str, int] | None = None  # (sync_id, phase, bytes_sent) of the last line
        self._last_at = 0.0

    def show(self, p: trainer_pb2.SyncProgress) -> None:
        key = (p.sync_id, p.phase, p.bytes_sent)
        if not p.phase or key == self._last:  # between two phases: the next one is shown
            return
        if self.tty:
            self.out.write("\r" + describe(p) + "\x1b[K")
        else:
            same_phase = self._last is not None and self._last[:2] == key[:2]
            if same_phase and time.monotonic() - self._last_at < PLAIN_EVERY_S:
                return
            self.out.write(describe(p) + "\n")
            self._last_at = time.monotonic()
        self.out.flush()
        self._last, self._shown = key, True

    def close(self) -> None:
        if self.tty and self._shown:  # the report follows on stdout: leave no half line behind
            self.out.write("\r\x1b[K")
            self.out.flush()


def watch(stub, call: grpc.Future, out: TextIO, poll_s: float = POLL_S) -> None:
    """Show the progress of the sync that `call` (a Sync future) waits for, until it ends."""
    ended = threading.Event()
    call.add_done_callback(lambda _: ended.set())
    line = ProgressLine(out)
    try:
        while not ended.is_set():
            try:
                p = stub.GetSyncProgress(trainer_pb2.SyncProgressRequest(), timeout=max(poll_s, 5.0))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older trainer: no progress to show
                    return
                p = None  # a poll lost; the Sync call's own outcome is what counts
            if p is not None and p.in_progress:
                line.show(p)
            ended.wait(poll_s)
    finally:
        line.close()
