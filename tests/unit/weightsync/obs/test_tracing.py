"""A sync is one OpenTelemetry trace across the trainer's and the rollout's code (in-process services on
loopback, the SDK's in-memory exporter): root `sync`, its phases as children, the rollout's prepare and
commit continuing the trainer's phase spans over gRPC (the first sync of a pairing) and over the sync
link (the next one), and generation requests (gRPC, HTTP whole and streamed) continuing the caller's
traceparent. With no endpoint and no provider nothing of OpenTelemetry is imported."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import openai
import pytest

from tests.support.local_apps import local_fleet
from weightsync.control.auth import call_metadata
from weightsync.control.client import channel
from weightsync.obs import tracing
from weightsync.obs.bucket_groups import MAX_GROUPS, BucketGroups
from weightsync.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

TOKEN = "trace-test-token"
PHASES = ("plan", "prepare", "stream", "commit")


def _in_memory():
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider


@pytest.fixture
def spans():
    exporter, provider = _in_memory()
    tracing.configure(provider)
    try:
        yield exporter
    finally:
        tracing.configure(None)
        provider.shutdown()


def _tree(finished, trace_id: int) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in finished:
        if s.context.trace_id == trace_id:
            out.setdefault(s.name, []).append(s)
    return out


def _check_sync_trace(finished, report, calls_path: str) -> None:
    roots = [s for s in finished if s.name == "sync" and s.attributes["weightsync.sync_id"] == report.sync_id]
    assert len(roots) == 1, [s.name for s in finished]
    root = roots[0]
    assert root.parent is None
    assert dict(root.attributes) == {
        "weightsync.sync_id": report.sync_id,
        "weightsync.version": report.version,
        # the report's route once it names one (e.g. tcp/full/bf16), else its transport
        "weightsync.route": getattr(report, "route", "") or report.transport,
        "weightsync.bytes": report.bytes,
        "weightsync.ok": True,
    }
    tree = _tree(finished, root.context.trace_id)
    for name in PHASES:  # each phase once, a child of the root
        assert [s.parent.span_id for s in tree[name]] == [root.context.span_id], (name, calls_path)
    # the rollout's spans (rollout_svc code) continue the trainer's phase that sent them: its prepare, and
    # its stream for the commit, which went out as the last bucket did (weightsync/publisher/early_commit.py)
    for side, sent_in in (("prepare", "prepare"), ("commit", "stream")):
        (mine,) = tree[f"rollout.{side}"]
        assert mine.parent.span_id == tree[sent_in][0].context.span_id, (side, calls_path)
        assert mine.attributes["weightsync.sync_id"] == report.sync_id
        assert mine.attributes["weightsync.version"] == report.version
        assert mine.attributes["weightsync.rollout_id"] == "a"
    (sender,) = tree["stream.sender"]
    assert sender.parent.span_id == tree["stream"][0].context.span_id
    assert sender.attributes["weightsync.bytes"] == report.senders[0].bytes > 0
    _check_groups(tree["stream.group"], sender, report)
    assert {s.resource.attributes.get("service.name") for s in tree["sync"]}  # exported with a resource


def _check_groups(groups, sender, report) -> None:
    """The sender's buckets in consecutive groups under its span: every bucket once, in order, bytes adding up."""
    groups = sorted(groups, key=lambda g: g.attributes["weightsync.bucket.first"])
    assert 1 <= len(groups) <= MAX_GROUPS
    assert report.num_buckets > MAX_GROUPS  # groups of several buckets
    assert len(groups) < report.num_buckets
    assert {g.parent.span_id for g in groups} == {sender.context.span_id}
    ranges = [(g.attributes["weightsync.bucket.first"], g.attributes["weightsync.bucket.last"]) for g in groups]
    assert [i for first, last in ranges for i in range(first, last + 1)] == list(range(report.num_buckets))
    assert [g.attributes["weightsync.buckets"] for g in groups] == [last - first + 1 for first, last in ranges]
    assert sum(g.attributes["weightsync.bytes"] for g in groups) == report.senders[0].bytes
    assert all(0 < g.attributes["weightsync.bytes"] for g in groups)
    assert all(sender.start_time <= g.start_time <= g.end_time <= sender.end_time for g in groups)


def test_a_sync_is_one_trace_over_grpc_then_the_sync_link_and_generation_continues_the_callers(spans):
    with local_fleet({"a": {}}, TOKEN) as (trainer, rollouts, stub):
        # buckets of 16 KiB (bucket_mb is whole MiB: the model is one): dozens, more than one per group
        trainer.orch.bucket_bytes = 16 << 10
        first = stub.Sync(trainer_pb2.SyncRequest()).report
        assert first.ok, first
        _check_sync_trace(spans.get_finished_spans(), first, "grpc")
        spans.clear()
        second = stub.Sync(trainer_pb2.SyncRequest()).report
        assert second.ok, second
        _check_sync_trace(spans.get_finished_spans(), second, "link")
        calls = trainer.host.metrics.calls  # the second PrepareSync went over the link
        assert calls.labels("trainer", "PrepareSync", "link")._value.get() >= 1
        spans.clear()

        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        with channel(rollouts["a"].grpc.address) as ch:
            rollout_pb2_grpc.RolloutStub(ch).Generate(
                rollout_pb2.GenerateRequest(
                    prompts=[rollout_pb2.Prompt(token_ids=[1, 2, 3])],
                    sampling=rollout_pb2.SamplingParams(max_new_tokens=2),
                ),
                timeout=60,
                metadata=(*call_metadata(TOKEN), ("traceparent", parent)),
            )
        # HTTP completions, whole and streamed, continue their caller's traceparent header too
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{rollouts['a'].http.port}/v1", api_key=TOKEN, max_retries=0, timeout=60
        )
        for i, stream in enumerate((False, True)):
            answer = client.completions.create(
                model="tiny-qwen2",
                prompt=[1, 2, 3],
                max_tokens=2,
                stream=stream,
                extra_headers={"traceparent": parent.replace("b7ad6b7169203331", f"00000000000000a{i}")},
            )
            if stream:
                list(answer)
    gens = sorted((s for s in spans.get_finished_spans() if s.name == "generate"), key=lambda s: s.parent.span_id)
    assert [(f"{s.parent.span_id:016x}", s.attributes["weightsync.endpoint"]) for s in gens] == [
        ("00000000000000a0", "http_completions"),
        ("00000000000000a1", "http_completions"),
        ("b7ad6b7169203331", "grpc_generate"),
    ]
    assert {f"{s.context.trace_id:032x}" for s in gens} == {"0af7651916cd43dd8448eb211c80319c"}


def test_an_ipc_commit_carried_on_the_bucket_stream_continues_the_trainer_s_commit(spans, monkeypatch):
    """Over CUDA IPC (faked at the GPU boundary, as tests/unit/weightsync/bus/ipc/ does) with the sync
    link off, each rollout takes the commit as the last message of its IpcBuckets stream, not as a
    CommitSync call: its `rollout.commit` still continues the trainer's `commit` span."""
    from tests.support.fake_gpu import GPU, FakeGpu
    from tests.support.fleet_sync import bump_weights
    from weightsync.bus.ipc.handles import HandleCache, MappedBuffers

    gpu = FakeGpu()
    with local_fleet({"a": {}, "b": {}}, TOKEN) as (trainer, rollouts, stub):
        ipc = trainer.orch.transports["ipc"]
        ipc.needs_cuda, ipc.uuid_of, ipc.cache = False, (lambda d: GPU), HandleCache(gpu.share)
        for app in rollouts.values():
            app.servicer.ipc.check = lambda spec: GPU if spec.device_uuid == GPU else "GPU-other"
            app.servicer.ipc.maps = MappedBuffers(gpu.open)
        monkeypatch.setattr(trainer.orch.rollouts, "sync_link", False)
        calls, call = [], trainer.orch.rollouts.call
        monkeypatch.setattr(trainer.orch.rollouts, "call", lambda e, m, r: calls.append(m) or call(e, m, r))
        bump_weights(trainer)
        report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert report.ok, [r.error for r in report.rollouts]
    assert calls == ["PrepareSync", "PrepareSync"]  # the commits rode the streams
    (root,) = [s for s in spans.get_finished_spans() if s.name == "sync"]
    tree = _tree(spans.get_finished_spans(), root.context.trace_id)
    (commit,) = tree["commit"]
    ends = {s.attributes["weightsync.rollout_id"]: s for s in tree["rollout.commit"]}
    assert sorted(ends) == ["a", "b"]
    for s in ends.values():
        assert s.parent.span_id == commit.context.span_id
        assert s.attributes["weightsync.via"] == "ipc_stream"
        assert (s.attributes["weightsync.sync_id"], s.attributes["weightsync.version"]) == (
            report.sync_id,
            report.version,
        )
    assert {s.attributes["weightsync.via"] for s in tree["rollout.prepare"]} == {"rpc"}


def test_the_rl_loop_s_generations_continue_the_span_it_runs_them_under():
    """The RL driver's Generate calls (one pool thread per rollout) carry the caller's current span: each
    rollout's `generate` span is its child, in its trace; outside a span a generation starts a trace."""
    from weightsync.rl.driver import LoopConfig

    cfg = LoopConfig(prompts_per_step=2, group_size=1, max_new_tokens=2)
    spans, provider = _in_memory()
    tracing.configure(provider)
    try:
        _loop_under_a_span(spans, provider, cfg)
    finally:
        tracing.configure(None)
        provider.shutdown()


def _loop_under_a_span(spans, provider, cfg) -> None:
    from opentelemetry import trace

    from weightsync.control.client import rollout_stub
    from weightsync.rl.driver import _generate

    with local_fleet({"a": {"serve_initial_weights": True}, "b": {"serve_initial_weights": True}}, TOKEN) as fleet:
        stubs = [rollout_stub(channel(app.grpc.address), TOKEN, 60) for app in fleet.rollouts.values()]
        with trace.get_tracer("rl-loop", tracer_provider=provider).start_as_current_span("rl.step") as step:
            _generate(stubs, [[1, 2, 3], [4, 5, 6]], cfg, seed=1)
        _generate(stubs, [[1, 2, 3], [4, 5, 6]], cfg, seed=2)
    gens = [s for s in spans.get_finished_spans() if s.name == "generate"]
    assert len(gens) == 4
    under = [s for s in gens if s.parent is not None]
    assert [(s.parent.span_id, s.context.trace_id) for s in under] == [
        (step.get_span_context().span_id, step.get_span_context().trace_id)
    ] * 2
    assert all(s.context.trace_id != step.get_span_context().trace_id for s in gens if s.parent is None)


def test_a_call_carries_the_embedding_process_s_own_span_even_with_tracing_off_here():
    from opentelemetry import trace

    exporter, provider = _in_memory()
    tracing.configure(None)  # off here: no endpoint (the caller traces with its own provider)
    assert not tracing.enabled() and tracing.call_traceparent() == ""
    with trace.get_tracer("caller", tracer_provider=provider).start_as_current_span("step") as span:
        ctx = span.get_span_context()
        assert tracing.call_traceparent() == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        assert tracing.traceparent() == ""  # a sync's own requests stay untraced while off here
    provider.shutdown()


def test_off_without_endpoint_imports_no_opentelemetry():
    """Off, the helpers import nothing of OpenTelemetry (the control plane's fastapi may import its API
    for its own use; neither the SDK nor an exporter is ever loaded)."""
    code = (
        "import os, sys\n"
        "for v in ('OTEL_EXPORTER_OTLP_ENDPOINT', 'OTEL_EXPORTER_OTLP_TRACES_ENDPOINT'): os.environ.pop(v, None)\n"
        "from weightsync.obs import tracing\n"
        "def sync():\n"
        "    with tracing.sync_span('tcp') as t:\n"
        "        tracing.planned('v1-x', 1, 10)\n"
        "        with tracing.phase('plan'): pass\n"
        "        assert tracing.traceparent() == ''\n"
        "        t.finish(None)\n"
        "sync()\n"
        "bare = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "from weightsync.publisher.phases import PhaseClock\n"
        "with PhaseClock()('plan'): sync()\n"
        "assert not tracing.enabled()\n"
        "print(bare, sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr


def test_with_the_standard_endpoint_variable_spans_go_out_over_otlp_http(monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    bodies: list[tuple[str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    tracing.setup("trainer-svc")
    tracing.configure(None)  # read the environment afresh
    try:
        with tracing.sync_span("tcp"):
            tracing.planned("v7-otlp", 7, 1234)
            with tracing.phase("plan"):
                assert tracing.traceparent().startswith("00-")
        assert tracing.flush(30)
    finally:
        tracing.configure(None)
        tracing.setup("weightsync")
        server.shutdown()
    (path, body), *_ = bodies
    assert path == "/v1/traces"
    for text in (b"trainer-svc", b"v7-otlp", b"weightsync.sync_id", b"plan", b"sync"):
        assert text in body, text


def test_a_thousand_buckets_make_at_most_sixteen_groups_with_their_ranges_and_bytes():
    rec = BucketGroups(list(range(1000)))
    for i in range(1000):
        rec.sent(10 + i % 2)
    groups = rec.close()
    # ceil(1000 / 16) = 63 buckets a group: 15 full groups and the 55 left
    assert [(g[0], g[1], g[2]) for g in groups] == [(63 * k, 63 * k + 62, 63) for k in range(15)] + [(945, 999, 55)]
    assert sum(g[3] for g in groups) == sum(10 + i % 2 for i in range(1000))
    assert [g[4] for g in groups[1:]] == [g[5] for g in groups[:-1]]  # each starts where the last ended


def test_a_sender_s_own_buckets_keep_their_manifest_indices_and_a_broken_stream_shows_how_far_it_came():
    rec = BucketGroups([1, 3, 5, 7, 9], max_groups=2)  # a rank's share of a multi-sender stream
    for _ in range(4):
        rec.sent(100)
    assert [g[:4] for g in rec.close()] == [[1, 5, 3, 300], [7, 7, 1, 100]]
