"""The sync link: PrepareSync, CommitSync and AbortSync as frames on one connection per rollout.

Real TrainerApp (hf backend) and RolloutApps on loopback with a token, TCP bus. Checked: after
the first prepare of a pairing (over gRPC, which names the link) every call goes over the link
and the weights stay bit-exact; a rollout with the link off is synced over gRPC throughout; a
link the rollout closed is reopened, one it refuses falls back to gRPC; the link answers errors
with the codes gRPC gives, refuses a wrong token, an unknown method, a garbled or an oversized
request, and a link past max_sync_links; a call not answered in time fails and the next one
opens a fresh link.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest

from tests.support.fleet_sync import bump_and_sync_exactly, rollout_calls
from tests.support.link_peer import link_handshake
from tests.support.local_apps import local_fleet
from weightsync.control.client import channel, rollout_stub
from weightsync.control.sync_link import (
    ACCEPTED,
    read_frame,
    recv_exact,
    status_code,
)
from weightsync.publisher.link_client import LinkDown, SyncLinkClient
from weightsync.v1 import rollout_pb2

TOKEN = "link-s3cret"


@pytest.fixture(scope="module")
def fleet():
    links = {"a": ("staged", True), "b": ("inplace", True), "c": ("staged", False)}
    rollouts = {
        rid: {"apply_mode": mode, "sync_link": link, "max_sync_links": 2} for rid, (mode, link) in links.items()
    }
    with local_fleet(rollouts, TOKEN) as fleet:
        yield fleet


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def test_after_the_first_prepare_every_sync_call_goes_over_the_link(fleet):
    trainer, rollouts, stub = fleet
    before = rollout_calls(trainer)
    bump_and_sync_exactly(trainer, rollouts, stub)
    # the first prepare of each pairing is a gRPC call; its answer names the link, so the commit takes it
    assert _delta(before, rollout_calls(trainer)) == {
        ("PrepareSync", "grpc"): 3,
        ("CommitSync", "link"): 2,
        ("CommitSync", "grpc"): 1,
    }
    assert rollouts["c"].servicer.sync_link == "" and trainer.registry.get("c").link is None
    for rid in "ab":
        assert trainer.registry.get(rid).link.address == rollouts[rid].servicer.sync_link != ""
    served = {rid: rollouts[rid].link.requests for rid in "ab"}
    before = rollout_calls(trainer)
    bump_and_sync_exactly(trainer, rollouts, stub)
    assert _delta(before, rollout_calls(trainer)) == {
        ("PrepareSync", "link"): 2,
        ("CommitSync", "link"): 2,
        ("PrepareSync", "grpc"): 1,
        ("CommitSync", "grpc"): 1,
    }
    assert {rid: rollouts[rid].link.requests - served[rid] for rid in "ab"} == {"a": 2, "b": 2}
    assert rollouts["c"].link.requests == 0


def test_a_link_the_rollout_closed_is_reopened_and_a_refused_one_falls_back_to_grpc(fleet):
    trainer, rollouts, stub = fleet
    bump_and_sync_exactly(trainer, rollouts, stub)  # every link open
    link = rollouts["a"].link
    for conn in list(link._open):  # the rollout drops its end, as a restarted one would have
        conn.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 5
    while link._open and time.monotonic() < deadline:
        time.sleep(0.01)
    before = rollout_calls(trainer)
    bump_and_sync_exactly(trainer, rollouts, stub)
    assert _delta(before, rollout_calls(trainer)).get(("PrepareSync", "link")) == 2  # "a" reopened it before sending

    link.token = "not-the-token"  # "a" now refuses the trainer's link handshake
    for conn in list(link._open):
        conn.shutdown(socket.SHUT_RDWR)
    time.sleep(0.05)
    before = rollout_calls(trainer)
    bump_and_sync_exactly(trainer, rollouts, stub)  # still committed everywhere: "a" over gRPC
    delta = _delta(before, rollout_calls(trainer))
    assert delta[("PrepareSync", "grpc")] == 2 and delta[("CommitSync", "grpc")] == 2, delta
    entry = trainer.registry.get("a")
    assert not entry.link.usable() and entry.link.retry_at > time.monotonic() + 30
    link.token = TOKEN
    entry.link.retry_at = 0.0
    before = rollout_calls(trainer)
    bump_and_sync_exactly(trainer, rollouts, stub)
    assert _delta(before, rollout_calls(trainer))[("PrepareSync", "link")] == 2


def test_the_link_answers_with_the_codes_grpc_gives(fleet):
    trainer, rollouts, _ = fleet
    app = rollouts["a"]
    client = SyncLinkClient(app.servicer.sync_link, TOKEN)
    stub = rollout_stub(channel(app.grpc.address), TOKEN, 10)
    commit = rollout_pb2.CommitSyncRequest(sync_id="never-prepared", version=99, trainer_id=trainer.orch.trainer_id)
    foreign = rollout_pb2.PrepareSyncRequest(trainer_id="another-trainer", timeout_seconds=5)
    foreign.transport.tcp.SetInParent()
    bad_timeout = rollout_pb2.PrepareSyncRequest(trainer_id=trainer.orch.trainer_id, timeout_seconds=float("inf"))
    for method, req in (("CommitSync", commit), ("PrepareSync", foreign), ("PrepareSync", bad_timeout)):
        resp, err = client.call(method, req, 5)
        with pytest.raises(grpc.RpcError) as over_grpc:
            getattr(stub, method)(req)
        assert resp is None and err == f"{over_grpc.value.code().name}: {over_grpc.value.details()}"
    resp, err = client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="never-prepared"), 5)
    assert err == "" and resp.state == rollout_pb2.SERVING and resp.version == app.tx.version
    client.close()
    with pytest.raises(LinkDown, match="could not be opened"):
        SyncLinkClient(app.servicer.sync_link, "wrong-token").call("AbortSync", rollout_pb2.AbortSyncRequest(), 5)


def _open_raw(address: str, token: str = TOKEN) -> socket.socket:
    sock = link_handshake(address, token)
    assert recv_exact(sock, 1, time.monotonic() + 5) == ACCEPTED
    return sock


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_link_refuses_unknown_garbled_oversized_and_extra_links(fleet):
    _, rollouts, _ = fleet
    app = rollouts["b"]
    sock = _open_raw(app.servicer.sync_link)
    sock.sendall(struct.pack("<BI", 9, 3) + b"abc")
    code, details = read_frame(sock, time.monotonic() + 5)
    assert status_code(code) == grpc.StatusCode.UNIMPLEMENTED and b"no method 9" in details
    sock.sendall(struct.pack("<BI", 2, 4) + b"\xff\xff\xff\xff")  # not a CommitSyncRequest
    code, details = read_frame(sock, time.monotonic() + 5)
    assert status_code(code) == grpc.StatusCode.INVALID_ARGUMENT and b"not a valid protobuf message" in details
    abort = rollout_pb2.AbortSyncRequest(sync_id="x").SerializeToString()
    sock.sendall(struct.pack("<BI", 3, len(abort)) + abort)  # the link still serves after refused requests
    code, payload = read_frame(sock, time.monotonic() + 5)
    assert code == 0 and rollout_pb2.AbortSyncResponse.FromString(payload).state == rollout_pb2.SERVING
    limit = app.grpc.request_limits["/weightsync.v1.Rollout/PrepareSync"]
    sock.sendall(struct.pack("<BI", 1, limit + 1))  # refused on its length, before a byte of it is read
    code, details = read_frame(sock, time.monotonic() + 5)
    assert status_code(code) == grpc.StatusCode.INVALID_ARGUMENT and f"limit of {limit} bytes".encode() in details
    assert _closed(sock)

    # max_sync_links=2: the trainer's link and one more; a third is closed once authenticated (a
    # handshake holds no slot: tests/unit/weightsync/control/test_sync_link_liveness.py)
    deadline = time.monotonic() + 5
    while len(app.link._open) > 1 and time.monotonic() < deadline:  # the refused one above is gone
        time.sleep(0.01)
    held = [_open_raw(app.servicer.sync_link) for _ in range(2 - len(app.link._open))]
    extra = link_handshake(app.servicer.sync_link, TOKEN)
    assert _closed(extra)
    for s in held + [extra]:
        s.close()


def test_a_call_not_answered_in_time_fails_and_the_next_opens_a_fresh_link(fleet, monkeypatch):
    _, rollouts, _ = fleet
    app = rollouts["a"]
    abort = app.servicer.AbortSync

    def slow(request, context):
        time.sleep(1.0)
        return abort(request, context)

    monkeypatch.setattr(app.servicer, "AbortSync", slow)
    client = SyncLinkClient(app.servicer.sync_link, TOKEN)
    t0 = time.monotonic()
    resp, err = client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="x"), 0.2)
    assert resp is None and err.startswith("DEADLINE_EXCEEDED") and time.monotonic() - t0 < 0.9
    monkeypatch.setattr(app.servicer, "AbortSync", abort)
    deadline = time.monotonic() + 5
    while len(app.link._open) > 1 and time.monotonic() < deadline:  # the slow handler's link slot frees at its end
        time.sleep(0.01)
    resp, err = client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="y"), 5)
    assert err == "" and resp.state == rollout_pb2.SERVING  # not the late answer to "x": a new connection
    client.close()


def test_an_idle_link_counts_as_closed_once_the_rollout_closed_its_end():
    from weightsync.publisher.link_client import _drain

    def _closed_by_peer(sock):
        return not _drain(sock)[1]

    ours, theirs = socket.socketpair()
    try:
        assert not _closed_by_peer(ours)
        theirs.close()
        assert _closed_by_peer(ours)
        ours.close()
        assert _closed_by_peer(ours)  # a socket closed here too
    finally:
        ours.close()


def test_an_idle_links_answered_pings_are_read_whole_and_part_of_a_frame_makes_it_unusable():
    from weightsync.control.sync_link import BEAT, frame
    from weightsync.publisher.link_client import _drain

    ours, theirs = socket.socketpair()
    try:
        assert _drain(ours) == (0, True)
        theirs.sendall(frame(BEAT, b"") * 3)
        assert _drain(ours) == (3, True)
        assert _drain(ours) == (0, True)  # read, not just peeked
        theirs.sendall(frame(BEAT, b"")[:2])
        assert _drain(ours) == (0, False)  # a next call would misread it
    finally:
        ours.close()
        theirs.close()


def test_ping_between_calls_is_answered_by_the_link_thread_and_the_next_call_reads_past_the_beats(fleet):
    """A ping is answered while no request is handled (the stream phase), and its BEATs left on the
    link are not taken for the next call's answer."""
    client = SyncLinkClient(fleet[1]["a"].servicer.sync_link, TOKEN)
    resp, err = client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="x"), 5, liveness=1.0)
    assert err == "" and resp.state == rollout_pb2.SERVING
    before = client.last_heard
    deadline = time.monotonic() + 5
    while client.last_heard == before and time.monotonic() < deadline:
        client.ping()
        time.sleep(0.02)
    assert client.last_heard > before, "the rollout never answered a ping"
    for _ in range(3):
        client.ping()  # answers left in flight
    time.sleep(0.05)
    resp, err = client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="y"), 5, liveness=1.0)
    assert err == "" and resp.state == rollout_pb2.SERVING
    client.close()


def test_a_refused_connection_is_retried_within_a_second_a_refused_handshake_after_a_minute(fleet):
    _, rollouts, _ = fleet
    with socket.socket() as s:  # a port nobody listens on: the rollout is down
        s.bind(("127.0.0.1", 0))
        down = SyncLinkClient(f"127.0.0.1:{s.getsockname()[1]}", TOKEN)
    with pytest.raises(LinkDown, match="could not be opened"):
        down.call("AbortSync", rollout_pb2.AbortSyncRequest(), 5)
    assert 0 < down.retry_at - time.monotonic() <= 1.0
    wrong = SyncLinkClient(rollouts["a"].servicer.sync_link, "wrong-token")
    with pytest.raises(LinkDown):
        wrong.call("AbortSync", rollout_pb2.AbortSyncRequest(), 5)
    assert wrong.retry_at - time.monotonic() > 30


def test_a_call_sent_in_two_halves_is_handled_before_its_answer_is_read_and_frees_the_link_after(fleet):
    """SyncLinkClient.send: the request is out (the rollout handles it) before the caller reads the answer,
    which it reads once; the link takes the next call only then. A send that never reached the rollout
    raises LinkDown and leaves the link free."""
    _, rollouts, _ = fleet
    app = rollouts["a"]
    client = SyncLinkClient(app.servicer.sync_link, TOKEN)
    handled, abort = threading.Event(), app.servicer.AbortSync

    def spy(request, context):
        try:
            return abort(request, context)
        finally:
            handled.set()

    app.servicer.AbortSync = spy  # the link dispatches to the servicer's attribute
    try:
        answer = client.send("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="none"), 10)
        assert handled.wait(10)  # answered by the rollout while nothing reads the link
        assert not client._lock.acquire(blocking=False)  # one request at a time: taken until the answer is read
        resp, err = answer()
        assert err == "" and resp.state == app.tx.state
        with pytest.raises(RuntimeError, match="already read"):
            answer()
        assert client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="none"), 10)[1] == ""
    finally:
        del app.servicer.AbortSync
        client.close()
    refused = SyncLinkClient(f"127.0.0.1:{_free_port()}", TOKEN)
    with pytest.raises(LinkDown, match="could not be opened"):
        refused.send("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="none"), 2)
    assert refused._lock.acquire(blocking=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
