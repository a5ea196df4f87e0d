"""Property-based fuzzing of the gRPC handlers (issue #7) against real in-process servers.

A RolloutApp (built-in engine, tiny-qwen2) and a TrainerApp (hf backend) run on loopback ports.
Every fuzzed call must end OK or with a deliberate status code — never UNKNOWN (an unhandled
exception in a handler) or INTERNAL — and the servers must keep serving: GetStatus works and a
real sync still commits at the end.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.local_apps import local_fleet
from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.v1 import bus_pb2, rollout_pb2, trainer_pb2

ROLLOUT_METHODS = {
    "GetStatus": rollout_pb2.GetStatusRequest,
    "Generate": rollout_pb2.GenerateRequest,
    "Score": rollout_pb2.ScoreRequest,
    "PrepareSync": rollout_pb2.PrepareSyncRequest,
    "PushBucket": rollout_pb2.PushBucketRequest,
    "CommitSync": rollout_pb2.CommitSyncRequest,
    "AbortSync": rollout_pb2.AbortSyncRequest,
}
# ExportHf / SaveCheckpoint write to a client-chosen path: fuzzed only with paths under tmp (below)
TRAINER_METHODS = {
    "RegisterRollout": trainer_pb2.RegisterRolloutRequest,
    "DeregisterRollout": trainer_pb2.DeregisterRolloutRequest,
    "Sync": trainer_pb2.SyncRequest,
    "GetStatus": trainer_pb2.TrainerStatusRequest,
    "LoadWeights": trainer_pb2.LoadWeightsRequest,
    "ComputeLogprobs": trainer_pb2.ComputeLogprobsRequest,
}
# a crash in a server thread (e.g. the abort timer) fails the test too
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    # ExportHf's fuzzed paths lie under tmp: the trainer's data root, so they are really written
    fields = {"rpc_timeout_s": 3.0, "sync_timeout_s": 20.0, "data_root": str(tmp)}
    with local_fleet({"real": {"sync_timeout_s": 20.0}}, stub_timeout_s=30, **fields) as (trainer, rollouts, _):
        yield trainer, rollouts["real"], tmp


def _raw(address: str, service: str, method: str, payload: bytes) -> grpc.StatusCode:
    ch = channel(address)
    try:
        call = ch.unary_unary(f"/weightsync.v1.{service}/{method}", request_serializer=None, response_deserializer=None)
        call(payload, timeout=30)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert exc.code() not in BAD, f"{service}.{method}({payload!r}): {exc.code().name}: {exc.details()}"
        return exc.code()
    finally:
        ch.close()


def _call(stub, method: str, req) -> grpc.StatusCode:
    try:
        getattr(stub, method)(req, timeout=30)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert exc.code() not in BAD, f"{method}({req}): {exc.code().name}: {exc.details()}"
        # the server's own DEADLINE_EXCEEDED (a sync deadline) carries a message; the client's means a hang
        assert exc.details() != "Deadline Exceeded", f"{method} hung: {req}"
        return exc.code()


@settings(max_examples=150, **SETTINGS)
@given(method=st.sampled_from(sorted(ROLLOUT_METHODS)), payload=st.binary(max_size=300))
def test_rollout_random_bytes(servers, method, payload):
    _raw(servers[1].grpc.address, "Rollout", method, payload)


@settings(max_examples=100, **SETTINGS)
@given(method=st.sampled_from(sorted(TRAINER_METHODS)), payload=st.binary(max_size=300))
def test_trainer_random_bytes(servers, method, payload):
    _raw(servers[0].grpc.address, "Trainer", method, payload)


ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
small = st.integers(min_value=-3, max_value=600)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.inf, -math.inf, math.nan, 1e300, 1e12])
)
text = st.text(max_size=40)


@st.composite
def sampling(draw):
    return rollout_pb2.SamplingParams(
        max_new_tokens=draw(st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))),
        temperature=draw(floats),
        top_p=draw(floats),
        top_k=draw(st.integers(-(2**31), 2**31 - 1)),
        seed=draw(st.integers(0, 2**64 - 1)),
        stop_token_ids=draw(st.lists(ints, max_size=3)),
        n=draw(st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1))),
    )


@settings(max_examples=120, **SETTINGS)
@given(prompts=st.lists(st.lists(st.one_of(small, ints), max_size=12), max_size=3), s=sampling(), lp=st.booleans())
def test_generate_structured(servers, prompts, s, lp):
    req = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts], sampling=s, return_logprobs=lp
    )
    _call(rollout_stub(channel(servers[1].grpc.address), ""), "Generate", req)


@settings(max_examples=120, **SETTINGS)
@given(ids=st.lists(st.one_of(small, ints), max_size=12), pl=st.integers(0, 2**32 - 1), last=st.booleans())
def test_score_structured(servers, ids, pl, last):
    req = rollout_pb2.ScoreRequest(token_ids=ids, prompt_length=pl, return_last_logits=last)
    _call(rollout_stub(channel(servers[1].grpc.address), ""), "Score", req)


@st.composite
def manifests(draw, real: bus_pb2.Manifest):
    """Mutations of the real manifest (so validation goes deep) and free-form garbage."""
    m = bus_pb2.Manifest()
    m.CopyFrom(real)
    m.sync_id = draw(st.one_of(st.just("fz-1"), text))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(
            st.sampled_from(
                ["version", "total", "bsize", "offset", "nbytes", "shape", "dtype", "name", "drop", "dup", "algo"]
            )
        )
        if not m.buckets:
            break
        b = m.buckets[draw(st.integers(0, len(m.buckets) - 1))]
        t = b.tensors[draw(st.integers(0, len(b.tensors) - 1))] if len(b.tensors) else None
        if kind == "version":
            m.version = draw(st.integers(0, 2**64 - 1))
        elif kind == "total":
            m.total_bytes = draw(st.integers(0, 2**64 - 1))
        elif kind == "bsize":
            m.bucket_bytes = draw(st.integers(0, 2**64 - 1))
        elif kind == "nbytes":
            b.nbytes = draw(st.integers(0, 2**64 - 1))
        elif t is not None and kind == "offset":
            t.offset = draw(st.integers(0, 2**64 - 1))
        elif t is not None and kind == "shape":
            del t.shape[:]
            t.shape.extend(draw(st.lists(st.integers(0, 2**63 - 1), max_size=4)))
        elif t is not None and kind == "dtype":
            t.dtype = draw(st.integers(-(2**31), 2**31 - 1))
        elif t is not None and kind == "name":
            t.name = draw(text)
        elif kind == "drop":
            del m.buckets[-1]
        elif kind == "dup":
            m.buckets.add().CopyFrom(b)
        elif kind == "algo":
            m.checksum_algo = draw(text)
    return m


def _real_manifest(trainer) -> bus_pb2.Manifest:
    from weightsync.bus.plan import make_manifest, manifest_to_proto

    actor = trainer.actor
    return manifest_to_proto(
        make_manifest(
            actor.export_metas(),
            version=actor.version,
            sync_id="fz-1",
            bucket_bytes=1 << 16,
            model_family=actor.family,
            checksum_algo="ws-sum64-v1",
        )
    )


def test_sync_rpcs_structured(servers):
    trainer, rollout, _ = servers
    real = _real_manifest(trainer)
    stub = rollout_stub(channel(rollout.grpc.address), "")
    sid = st.one_of(st.just("fz-1"), text)

    @settings(max_examples=150, **SETTINGS)
    @given(
        m=manifests(real),
        timeout=st.one_of(floats, st.just(0.5)),
        kind=st.sampled_from(["tcp", "ipc", "none"]),
        follow=st.lists(
            st.tuples(
                st.sampled_from(["push", "commit", "abort"]),
                sid,
                st.integers(0, 2**32 - 1),
                st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)), max_size=3),
            ),
            max_size=3,
        ),
    )
    def run(m, timeout, kind, follow):
        req = rollout_pb2.PrepareSyncRequest(manifest=m, timeout_seconds=timeout)
        if kind == "tcp":
            req.transport.tcp.SetInParent()
        elif kind == "ipc":
            req.transport.ipc.SetInParent()
        _call(stub, "PrepareSync", req)
        for what, s, idx, sums in follow:
            if what == "push":
                r = rollout_pb2.PushBucketRequest(sync_id=s, index=idx, checksum=sums[0][1] if sums else 0)
                _call(stub, "PushBucket", r)
            elif what == "commit":
                r = rollout_pb2.CommitSyncRequest(sync_id=s, version=idx)
                for i, c in sums:
                    r.checksums.add(index=i, checksum=c)
                # a commit of a prepared sync without buckets waits for them until its deadline: keep it short
                _call(stub, "CommitSync", r) if not math.isfinite(timeout) or timeout < 2 or s != m.sync_id else None
            else:
                _call(stub, "AbortSync", rollout_pb2.AbortSyncRequest(sync_id=s, reason=s))
        _call(stub, "AbortSync", rollout_pb2.AbortSyncRequest(sync_id=m.sync_id))

    run()


def test_trainer_rpcs_structured(servers):
    trainer, rollout, tmp = servers
    stub = trainer_stub(channel(trainer.grpc.address), "", 60)
    addr = st.one_of(st.just(rollout.grpc.address), st.just("127.0.0.1:1"), text)

    @settings(max_examples=80, **SETTINGS)
    @given(
        op=st.sampled_from(["register", "deregister", "sync", "load", "export"]),
        rid=st.one_of(st.just("real"), text),
        address=addr,
        ranks=st.integers(-(2**31), 2**31 - 1),
        fam=st.one_of(st.just(""), text),
        ids=st.lists(st.one_of(st.just("real"), text), max_size=2),
        transport=st.one_of(st.sampled_from(["", "tcp", "nccl", "ipc"]), text),
        timeout=st.one_of(floats, st.just(3.0)),
        path=text,
    )
    def run(op, rid, address, ranks, fam, ids, transport, timeout, path):
        if op == "register":
            _call(
                stub,
                "RegisterRollout",
                trainer_pb2.RegisterRolloutRequest(rollout_id=rid, address=address, num_ranks=ranks, model_family=fam),
            )
        elif op == "deregister":
            if rid != "real":
                _call(stub, "DeregisterRollout", trainer_pb2.DeregisterRolloutRequest(rollout_id=rid))
        elif op == "sync":
            _call(stub, "Sync", trainer_pb2.SyncRequest(rollout_ids=ids, transport=transport, timeout_seconds=timeout))
        elif op == "load":
            _call(stub, "LoadWeights", trainer_pb2.LoadWeightsRequest(hf_path=path))
        else:
            safe = (tmp / "x").as_posix() + "".join(c for c in path if c.isalnum())
            _call(stub, "ExportHf", trainer_pb2.ExportHfRequest(out_dir=safe))

    run()


@pytest.mark.parametrize("t", [math.inf, math.nan, 1e300, -1.0])
def test_out_of_range_sync_timeouts_are_rejected(servers, t):
    """Found by fuzzing: timeout_seconds=inf was accepted and crashed the abort timer's thread."""
    trainer, rollout, _ = servers
    req = rollout_pb2.PrepareSyncRequest(manifest=_real_manifest(trainer), timeout_seconds=t)
    req.transport.tcp.SetInParent()
    assert (
        _call(rollout_stub(channel(rollout.grpc.address), ""), "PrepareSync", req) == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        _call(trainer_stub(channel(trainer.grpc.address), ""), "Sync", trainer_pb2.SyncRequest(timeout_seconds=t))
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_an_unknown_transport_is_refused_naming_the_field_and_the_choices(servers):
    trainer, rollout, _ = servers
    with pytest.raises(grpc.RpcError) as ei:
        trainer_stub(channel(trainer.grpc.address), "").Sync(trainer_pb2.SyncRequest(transport="udp"))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == "transport='udp' must be tcp, nccl or ipc"
    req = rollout_pb2.PrepareSyncRequest(
        manifest=_real_manifest(trainer), timeout_seconds=30, trainer_id=trainer.trainer_id
    )  # no transport set
    with pytest.raises(grpc.RpcError) as ei:
        rollout_stub(channel(rollout.grpc.address), "").PrepareSync(req)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "transport is unset: PrepareSync must say tcp, nccl or ipc" in ei.value.details()


def test_a_multi_sender_manifest_is_refused_over_ipc(servers):
    """IPC shares one GPU's buckets; tcp (a connection per sender) and nccl (a group per sender:
    tests/unit/weightsync/bus/nccl/test_nccl_multisender_rollout.py) carry several senders'."""
    trainer, rollout, _ = servers
    m = _real_manifest(trainer)
    assert len(m.buckets) > 1
    m.buckets[-1].sender = 1
    stub = rollout_stub(channel(rollout.grpc.address), "")
    tid = trainer.trainer_id  # the rollout follows this trainer once an earlier test synced it
    req = rollout_pb2.PrepareSyncRequest(manifest=m, timeout_seconds=30, trainer_id=tid)
    req.transport.ipc.SetInParent()
    with pytest.raises(grpc.RpcError) as ei:
        stub.PrepareSync(req)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "name senders [0, 1]; transport ipc carries the buckets of one sender" in ei.value.details()
    req = rollout_pb2.PrepareSyncRequest(manifest=m, timeout_seconds=30, trainer_id=tid)
    req.transport.tcp.SetInParent()
    assert stub.PrepareSync(req).transport.tcp.data_address
    stub.AbortSync(rollout_pb2.AbortSyncRequest(sync_id=m.sync_id, reason="test over", trainer_id=tid))


def test_servers_still_serve_and_sync_after_fuzzing(servers):
    trainer, rollout, _ = servers
    rstub = rollout_stub(channel(rollout.grpc.address), "")
    tstub = trainer_stub(channel(trainer.grpc.address), "", 120)
    assert rstub.GetStatus(rollout_pb2.GetStatusRequest()).rollout_id == "real"
    tstub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id="real", address=rollout.grpc.address))
    rep = tstub.Sync(trainer_pb2.SyncRequest(rollout_ids=["real"])).report
    assert rep.ok, rep
    st_ = rstub.GetStatus(rollout_pb2.GetStatusRequest())
    assert st_.state == rollout_pb2.SERVING and st_.version == trainer.actor.version
    g = rstub.Generate(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[1, 2, 3])]))
    assert g.version == trainer.actor.version and g.samples
