"""The sync link's liveness and pre-auth budget (issue 37).

A rollout acknowledges a request at once and keeps beating while it is slow, and its call succeeds
past `liveness`; one that went silent (a stopped process: the kernel still accepts and buffers,
nothing answers) fails the call after `liveness`, long before its timeout, and is marked silent; a
Sync with one silent rollout among three commits the other two without waiting for it (not even
the liveness: it never acknowledged), and the silent one is caught up exactly once it answers again.
Silent unauthenticated peers hold no link slot, and a link that cannot open says why (refused /
handshake rejected).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.support.link_peer import link_handshake
from tests.support.local_apps import local_fleet
from weightsync.control.client import channel, rollout_stub
from weightsync.control.sync_link import ACCEPTED, NONCE_BYTES, recv_exact
from weightsync.publisher.link_client import LinkDown, SyncLinkClient
from weightsync.v1 import rollout_pb2, trainer_pb2

TOKEN = "liveness-s3cret"
RPC_TIMEOUT_S = 60.0
LIVENESS_S = 1.0


@pytest.fixture(scope="module")
def fleet():
    rollouts = {rid: {"max_sync_links": 2} for rid in ("a", "b", "c")}
    with local_fleet(
        rollouts, TOKEN, stub_timeout_s=120, rpc_timeout_s=RPC_TIMEOUT_S, liveness_timeout_s=LIVENESS_S
    ) as fleet:
        yield fleet


def _sync(stub, rollout_ids=()) -> tuple[trainer_pb2.SyncReport, float]:
    t0 = time.monotonic()
    rep = stub.Sync(trainer_pb2.SyncRequest(rollout_ids=list(rollout_ids))).report
    return rep, time.monotonic() - t0


def test_a_slow_rollout_keeps_beating_and_its_call_outlives_the_liveness(fleet, monkeypatch):
    _, rollouts, _ = fleet
    app = rollouts["a"]
    abort = app.servicer.AbortSync

    def slow(request, context):
        time.sleep(3 * LIVENESS_S)
        return abort(request, context)

    monkeypatch.setattr(app.servicer, "AbortSync", slow)
    client = SyncLinkClient(app.servicer.sync_link, TOKEN)
    try:
        resp, err = client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="x"), 30, liveness=LIVENESS_S)
        assert err == "" and resp.state == rollout_pb2.SERVING and not client.silent
    finally:
        client.close()


def test_a_rollout_acknowledges_a_request_as_soon_as_it_reads_it(fleet, monkeypatch):
    """Before its first periodic beat: how a sync tells "has the request" from "silent" in milliseconds."""
    from weightsync.control.sync_link import BEAT_PERIOD_S

    _, rollouts, _ = fleet
    app = rollouts["b"]
    abort, started = app.servicer.AbortSync, threading.Event()

    def slow(request, context):
        started.set()
        time.sleep(BEAT_PERIOD_S * 4)
        return abort(request, context)

    monkeypatch.setattr(app.servicer, "AbortSync", slow)
    client = SyncLinkClient(app.servicer.sync_link, TOKEN)
    client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="warm"), 30, liveness=LIVENESS_S)  # opens it
    try:
        t0 = time.monotonic()
        worker = threading.Thread(
            target=client.call, args=("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="x"), 30, LIVENESS_S)
        )
        worker.start()
        assert started.wait(5)
        deadline = t0 + BEAT_PERIOD_S * 0.8
        while client.last_heard < t0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert client.last_heard >= t0, "no acknowledgement before the first periodic beat"
        worker.join(10)
    finally:
        client.close()


def _silent_rollout(answer_handshake: bool):
    """A listener that, like a SIGSTOPped rollout, never answers; with `answer_handshake` it first
    accepts the link (a rollout stopped after the link opened). Returns (address, close)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    held, stop = [], threading.Event()

    def run():
        lsock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except (TimeoutError, OSError):
                continue
            held.append(conn)
            recv_exact(conn, 4, time.monotonic() + 5)
            conn.sendall(b"\0" * NONCE_BYTES)
            recv_exact(conn, 32, time.monotonic() + 5)
            conn.sendall(ACCEPTED)  # then silence

    if answer_handshake:
        threading.Thread(target=run, daemon=True).start()

    def close():
        stop.set()
        for c in held:
            c.close()
        lsock.close()

    return f"127.0.0.1:{lsock.getsockname()[1]}", close


@pytest.mark.parametrize("answer_handshake", [True, False], ids=["stopped-after-link", "stopped-before-link"])
def test_a_silent_rollout_fails_the_call_after_the_liveness_not_the_timeout(answer_handshake):
    address, close = _silent_rollout(answer_handshake)
    client = SyncLinkClient(address, TOKEN)
    try:
        t0 = time.monotonic()
        resp, err = client.call("PrepareSync", rollout_pb2.PrepareSyncRequest(), 30, liveness=LIVENESS_S)
        took = time.monotonic() - t0
        assert resp is None and err.startswith("UNAVAILABLE") and client.silent, err
        assert "silent" in err or "did not answer the handshake" in err
        assert took < LIVENESS_S + 1.0, took
    finally:
        client.close()
        close()


@pytest.mark.serial
def test_one_silent_rollout_does_not_hold_the_sync_and_is_caught_up_when_it_answers(fleet):
    trainer, rollouts, stub = fleet
    rep, _ = _sync(stub)  # every pairing's first prepare goes over gRPC and names the link
    assert rep.ok, rep
    normal = min(_sync(stub)[1] for _ in range(2))

    stopped = rollouts["c"]
    release = threading.Event()
    prepare = stopped.servicer.PrepareSync

    def hung(request, context):  # as a SIGSTOPped process: no answer, and no beat
        release.wait(RPC_TIMEOUT_S)
        return prepare(request, context)

    stopped.servicer.PrepareSync = hung
    stopped.link._beater.begin = lambda conn, lock: None
    try:
        rep, took = _sync(stub)
    finally:
        release.set()
        stopped.servicer.PrepareSync = prepare
        del stopped.link._beater.begin
    by_id = {r.rollout_id: r for r in rep.rollouts}
    assert by_id["a"].ok and by_id["b"].ok, rep
    assert not by_id["c"].ok and "silent" in by_id["c"].error, by_id["c"]
    # the healthy two did not even wait the liveness for the silent one (let alone rpc_timeout_s): it was
    # dropped a short grace after they answered (weightsync.publisher.straggler)
    assert took < 2 * normal + LIVENESS_S + 2.0, (took, normal)
    assert took < LIVENESS_S, (took, normal)
    assert "dropped from this sync" in by_id["c"].error, by_id["c"]
    v = trainer.actor.version
    for rid in "ab":
        assert (
            rollout_stub(channel(rollouts[rid].grpc.address), TOKEN, 10)
            .GetStatus(rollout_pb2.GetStatusRequest())
            .version
            == v
        )

    # back: the catch-up (what its next registration queues) brings it to the trainer's version, exactly
    deadline = time.monotonic() + 30
    while True:
        rep, _ = _sync(stub, ["c"])
        if rep.ok or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rep.ok, rep
    st = rollout_stub(channel(stopped.grpc.address), TOKEN, 10).GetStatus(rollout_pb2.GetStatusRequest())
    assert st.version == v
    ref = rollout_stub(channel(rollouts["a"].grpc.address), TOKEN, 10)
    req = rollout_pb2.ScoreRequest(token_ids=[1, 2, 3, 4], prompt_length=1, return_last_logits=True)
    got = rollout_stub(channel(stopped.grpc.address), TOKEN, 10).Score(req)
    assert got.last_logits_f32 == ref.Score(req).last_logits_f32 and got.version == v


def test_silent_unauthenticated_peers_hold_no_link_slot(fleet):
    _, rollouts, _ = fleet
    app = rollouts["b"]
    silent = []
    try:
        for _ in range(4):  # twice max_sync_links, each stopped after the magic
            silent.append(link_handshake(app.servicer.sync_link, None))
        client = SyncLinkClient(app.servicer.sync_link, TOKEN)
        resp, err = client.call("AbortSync", rollout_pb2.AbortSyncRequest(sync_id="z"), 5, liveness=LIVENESS_S)
        assert err == "" and resp.state == rollout_pb2.SERVING
        client.close()
    finally:
        for s in silent:
            s.close()


def test_a_link_that_cannot_open_says_why(fleet):
    _, rollouts, _ = fleet
    with socket.socket() as s:  # nobody listens: refused
        s.bind(("127.0.0.1", 0))
        down = SyncLinkClient(f"127.0.0.1:{s.getsockname()[1]}", TOKEN)
    with pytest.raises(LinkDown, match="connection refused"):
        down.call("AbortSync", rollout_pb2.AbortSyncRequest(), 5)
    wrong = SyncLinkClient(rollouts["a"].servicer.sync_link, "wrong-token")
    with pytest.raises(LinkDown, match="handshake rejected") as exc:
        wrong.call("AbortSync", rollout_pb2.AbortSyncRequest(), 5)
    assert "wrong token" in str(exc.value)  # one of the causes it names, not the only one
