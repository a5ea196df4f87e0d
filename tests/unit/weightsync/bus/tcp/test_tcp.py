import socket
import threading
import time

import pytest
import torch

from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.errors import TransportError
from weightsync.bus.pack import unpack_bucket
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.bus.tcp.wire import TcpBucketReceiver, TcpBucketSender, hello_mac, read_hello


class Listener:
    """A loopback receiver that records what one sync delivered."""

    def __init__(self, manifest, token="tok", die_after=None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.manifest, self.token, self.die_after = manifest, token, die_after
        self.got, self.error, self.hello_ok = {}, None, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        conn, _ = self.sock.accept()
        sync_id, sender, mac = read_hello(conn, time.monotonic() + 5)
        self.hello_ok = sender == 0 and mac == hello_mac(self.token, sync_id, sender)
        rx = TcpBucketReceiver(conn)
        try:
            for plan in self.manifest.buckets:
                if self.die_after is not None and plan.index >= self.die_after:
                    conn.close()
                    return
                buf, csum = rx.recv(plan, timeout=5)
                assert csum == bucket_checksum(buf)
                for n, v in unpack_bucket(plan, buf):
                    self.got[n] = v.clone()
        except Exception as exc:
            self.error = exc
        finally:
            rx.close()


def _model(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}.w": torch.randn(32, 16 + i, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
        for i in range(n)
    }


def test_stream_to_two_receivers_is_bit_exact():
    ts = _model()
    m = make_manifest(
        [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()],
        version=1,
        sync_id="abc",
        bucket_bytes=4096,
        checksum_algo="ws-sum64-v1",
    )
    assert len(m.buckets) > 3
    rx = [Listener(m), Listener(m)]
    sender = TcpBucketSender({f"r{i}": r.address for i, r in enumerate(rx)}, "abc", "tok", timeout=5)
    stats = stream_buckets(m, iter(ts.items()), sender)
    sender.close()
    for r in rx:
        r.thread.join(5)
        assert r.hello_ok and r.error is None
        assert r.got.keys() == ts.keys()
        assert all(torch.equal(r.got[n], ts[n]) for n in ts)
    assert stats.bytes_sent == m.total_bytes and len(stats.checksums) == len(m.buckets)


def test_dead_receiver_is_dropped_and_the_other_still_gets_everything():
    ts = _model(n=40)
    m = make_manifest(
        [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()], version=1, sync_id="x", bucket_bytes=2048
    )
    good, dead = Listener(m), Listener(m, die_after=1)
    sender = TcpBucketSender({"good": good.address, "dead": dead.address}, "x", "tok", timeout=5)
    stream_buckets(m, iter(ts.items()), sender)
    assert "dead" in sender.failures() and "good" not in sender.failures()
    sender.close()
    good.thread.join(5)
    assert all(torch.equal(good.got[n], ts[n]) for n in ts)


def test_unreachable_target_only_fails_that_target():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    free = s.getsockname()[1]
    s.close()
    ts = _model(n=2)
    m = make_manifest(
        [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()], version=1, sync_id="y", bucket_bytes=1 << 20
    )
    good = Listener(m)
    sender = TcpBucketSender({"good": good.address, "gone": f"127.0.0.1:{free}"}, "y", "tok", timeout=2)
    assert "gone" in sender.failures()
    stream_buckets(m, iter(ts.items()), sender)
    sender.close()
    with pytest.raises(TransportError, match="no rollout reachable"):
        TcpBucketSender({"gone": f"127.0.0.1:{free}"}, "y", "tok", timeout=2)


def test_receiver_times_out_on_a_stalled_sender():
    ts = _model(n=2)
    m = make_manifest(
        [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()], version=1, sync_id="z", bucket_bytes=1 << 20
    )
    a, b = socket.socketpair()
    rx = TcpBucketReceiver(a)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="no header within"):
        rx.recv(m.buckets[0], timeout=0.5)
    assert time.monotonic() - t0 < 3
    b.close()
    rx.close()


def test_frame_that_disagrees_with_manifest_is_refused():
    import struct

    ts = _model(n=1)
    m = make_manifest(
        [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()], version=1, sync_id="z", bucket_bytes=1 << 20
    )
    a, b = socket.socketpair()
    b.sendall(struct.pack("<4sIQQB", b"WSB1", 0, 1 << 40, 0, 0))  # claims a 1 TiB bucket
    with pytest.raises(TransportError, match="manifest expects bucket 0"):
        TcpBucketReceiver(a).recv(m.buckets[0], timeout=2)
    b.close()


def test_a_restarted_receiver_binds_its_port_while_the_old_connections_linger_in_time_wait():
    """The data listener closes accepted connections first (a rollout killed mid-sync does), which
    leaves them in TIME_WAIT on its port; a receiver started again on that port must still bind."""
    from weightsync.bus.tcp.receiver import TcpReceiver

    first = TcpReceiver("127.0.0.1:0", transaction=None, token="tok")
    port = first.port
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn, _ = first.sock.accept()
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    time.sleep(0.1)
    client.close()
    first.sock.close()
    again = TcpReceiver(f"127.0.0.1:{port}", transaction=None, token="tok")
    try:
        assert again.port == port
        # a port that an active listener holds is still refused, naming the fix
        with pytest.raises(RuntimeError, match=rf"cannot listen on data_address 127.0.0.1:{port}: .*pick another port"):
            TcpReceiver(f"127.0.0.1:{port}", transaction=None, token="tok")
    finally:
        again.sock.close()


class _Stalled:
    """A peer that accepts the bus connection and then reads nothing (a stopped process): once the
    kernel buffers are full, a send to it blocks."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # inherited: fills sooner
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns = []
        threading.Thread(target=lambda: self.conns.append(self.sock.accept()[0]), daemon=True).start()

    def close(self):
        for c in [*self.conns, self.sock]:
            c.close()


def test_a_stalled_target_holds_the_others_only_until_it_is_dropped_and_they_get_everything():
    """One target stops reading mid-stream: the sends block on it (the buckets go to every target from
    one buffer, no copy each) until drop() shuts its socket down from another thread; then the healthy
    target's stream goes on at once and arrives bit-exact, and the stalled one is reported with the reason."""
    ts = {f"w{i}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(40)}
    m = make_manifest(
        [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in ts.items()], version=1, sync_id="st", bucket_bytes=1 << 20
    )
    assert m.total_bytes > 3 * (8 << 20)  # well past what the kernels' buffers can hold for the stalled peer
    good, stalled = Listener(m), _Stalled()
    sender = TcpBucketSender({"good": good.address, "stalled": stalled.address}, "st", "tok", timeout=30)
    blocked_at, dropped = [], threading.Event()

    def drop_when_blocked():
        # the stream is stuck once the bytes it handed on stop growing for a while
        last, since = -1, time.monotonic()
        while time.monotonic() - since < 0.3:
            time.sleep(0.05)
            now = sender.wire_bytes["good"]
            if now != last:
                last, since = now, time.monotonic()
        blocked_at.append(last)
        assert sender.drop("stalled", "stream: UNAVAILABLE: went silent")
        assert not sender.drop("stalled", "again")  # already out
        dropped.set()

    threading.Thread(target=drop_when_blocked, daemon=True).start()
    t0 = time.monotonic()
    stream_buckets(m, iter(ts.items()), sender, timeout=30)
    took = time.monotonic() - t0
    assert dropped.is_set() and blocked_at[0] < m.total_bytes  # it really was held by the stalled socket
    assert sender.failures() == {"stalled": "stream: UNAVAILABLE: went silent"}
    sender.close()
    stalled.close()
    good.thread.join(10)
    assert good.error is None and all(torch.equal(good.got[n], ts[n]) for n in ts)
    assert took < 10, took  # not the 30 s socket timeout
