"""`wsctl sync` shows the sync's phases and bytes as they happen (issue 37).

A real TrainerApp and RolloutApp on loopback, the rollout's data port behind tests.support.bus_proxy
paced so that the stream lasts a few poll periods however fast the box is: wsctl's stderr shows the
stream's bytes growing over several updates (plain lines without a terminal, one line rewritten in
place on one), stdout holds the report alone, and `--json` prints nothing but the report.
"""

from __future__ import annotations

import io
import json
import re

import pytest

from tests.support.bus_proxy import BusProxy
from tests.support.local_apps import local_fleet
from tests.support.paced_model import paced_model
from weightsync.local.procs import free_port
from weightsync.v1 import trainer_pb2
from weightsync.wsctl import progress
from weightsync.wsctl.cli import EXIT_OK, main

TOKEN = "progress-s3cret"
#: the paced stream's length: several polls (progress.POLL_S) and more than one plain-line period
STREAM_S = 2.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The paced bytes are mostly still on the trainer during the stream (tests/support/paced_model.py)."""
    return paced_model(tmp_path_factory.mktemp("progress-model"))


@pytest.fixture(scope="module")
def fleet(model_dir):
    dport = free_port()
    proxy = BusProxy("127.0.0.2", dport, ("127.0.0.1", dport))
    rollout = {"r": {"model": model_dir, "data_address": f"127.0.0.1:{dport}", "advertise_data_host": "127.0.0.2"}}
    try:
        with local_fleet(rollout, TOKEN, model=model_dir, sync_timeout_s=60.0) as (trainer, rollouts, stub):
            yield trainer, rollouts["r"], stub, proxy
    finally:
        proxy.close()


def _paced_sync(fleet, monkeypatch, argv):
    trainer, _, stub, proxy = fleet
    monkeypatch.setattr(trainer.orch.delta, "encoding", "full")  # every byte on the bus, every sync
    monkeypatch.setenv("WSCTL_TOKEN", TOKEN)
    assert stub.Sync(trainer_pb2.SyncRequest()).report.ok  # unpaced: the link is open, the layout known
    assert stub.GetSyncProgress(trainer_pb2.SyncProgressRequest()).in_progress is False
    total = trainer.orch.last_report.bytes
    trainer.actor.version += 1
    proxy.set("slow", rate=total / STREAM_S)
    try:
        return main(["--address", trainer.grpc.address, *argv]), total
    finally:
        proxy.set("pass")


def test_plain_lines_show_the_stream_bytes_growing_and_stdout_keeps_the_report(fleet, monkeypatch, capsys):
    code, total = _paced_sync(fleet, monkeypatch, ["sync"])
    out = capsys.readouterr()
    assert code == EXIT_OK, out
    assert out.out.startswith("sync v") and "r: committed v" in out.out, out.out  # the report alone
    lines = out.err.splitlines()
    # every line a progress line; one polled during planning has no version yet ("sync: plan, ...")
    progress = re.compile(r"sync( v\d+ \S+)?: [a-z_.]+[ ,]")
    assert lines and all(progress.match(line) for line in lines), out.err
    streamed = [int(float(m.group(1)) * 1e6) for m in map(re.compile(r": stream ([\d.]+)/").search, lines) if m]
    assert len(streamed) >= 2 and streamed == sorted(streamed) and streamed[0] < streamed[-1], out.err
    assert any(": commit" in line for line in lines), out.err
    assert f"/{total / 1e6:.1f} MB" in out.err and "1 rollout(s) over tcp" in out.err


def test_json_mode_prints_the_report_alone(fleet, monkeypatch, capsys):
    code, _ = _paced_sync(fleet, monkeypatch, ["sync", "--json"])
    out = capsys.readouterr()
    assert code == EXIT_OK and out.err == "", out
    assert json.loads(out.out)["ok"] is True


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_one_line_is_rewritten_in_place_and_cleared():
    tty = _Tty()
    line = progress.ProgressLine(tty)
    for sent in (0, 1_000_000, 1_000_000, 2_000_000):
        line.show(
            trainer_pb2.SyncProgress(
                in_progress=True, sync_id="v3-x", version=3, phase="stream", bytes=4_000_000, bytes_sent=sent
            )
        )
    line.show(trainer_pb2.SyncProgress(in_progress=True, sync_id="v3-x", version=3, phase="commit", bytes=4_000_000))
    line.close()
    text = tty.getvalue()
    assert "\n" not in text and text.count("\r") == 5 and text.endswith("\r\x1b[K"), repr(text)
    assert "stream 1.0/4.0 MB (25%)" in text and "stream 2.0/4.0 MB (50%)" in text and ": commit" in text
