"""/metrics of a running trainer and rollout (in process, loopback), read with Prometheus' own
text parser: the standard collectors are there, no `_created` twins, each side exports only its
own families, and one gRPC Generate moves the generation families by exactly its size."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import rollout_pb2

TOKEN = "metrics-test-token"
# families that only one side may export (TYPE/HELP included: an empty family is still exported)
TRAINER_ONLY = {
    "weightsync_sync_phase_seconds",
    "weightsync_sync_sender_bytes",
    "weightsync_sync_sender_seconds",
    "weightsync_sync_forwarded_bytes",
    "weightsync_sync_sender_buffer_bytes",
    "weightsync_sync_calls",
    "weightsync_registered_rollouts",
    "weightsync_train_steps",
    "weightsync_train_step",
    "weightsync_train_loss",
}
ROLLOUT_ONLY = {
    "weightsync_generate_requests",
    "weightsync_requests_refused",
    "weightsync_prefix_cache_hits",
    "weightsync_apply_seconds",
    "weightsync_rollout_state",
    "weightsync_ipc_mapped_buffers",
    "weightsync_ipc_handle_opens",
    "weightsync_generation_duration_seconds",
    "weightsync_prompt_tokens",
    "weightsync_completion_tokens",
    "weightsync_generation_requests_in_flight",
}
STANDARD = {
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_start_time_seconds",
    "python_info",
    "python_gc_collections",
}


@pytest.fixture(scope="module")
def services():
    from tests.support.local_apps import start_rollout, start_trainer

    trainer = start_trainer(auth_token=TOKEN)
    try:
        rollout = start_rollout("r1", auth_token=TOKEN, serve_initial_weights=True)
    except BaseException:
        trainer.stop()
        raise
    yield trainer, rollout
    rollout.stop()
    trainer.stop()


def scrape(port: int) -> dict:
    """family name -> family, as Prometheus' parser reads the text /metrics serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams, text[:500]
    return fams


def value(fams: dict, family: str, sample: str, **labels) -> float:
    hits = [s.value for s in fams[family].samples if s.name == sample and labels.items() <= s.labels.items()]
    assert len(hits) == 1, (sample, labels, fams[family].samples)
    return hits[0]


def test_each_side_exports_the_standard_collectors_its_own_families_and_no_created_series(services):
    trainer, rollout = services
    t, r = scrape(trainer.http.port), scrape(rollout.http.port)
    for side, fams in (("trainer", t), ("rollout", r)):
        assert STANDARD <= set(fams), (side, STANDARD - set(fams))
        assert value(fams, "process_start_time_seconds", "process_start_time_seconds") > 0
        created = [s.name for f in fams.values() for s in f.samples if s.name.endswith("_created")]
        created += [n for n in fams if n.endswith("_created")]
        assert not created, (side, created)
    # the trainer's TrainStep families appear once it trains; the rest of TRAINER_ONLY from the start
    assert TRAINER_ONLY - {"weightsync_train_steps", "weightsync_train_step", "weightsync_train_loss"} <= set(t)
    assert ROLLOUT_ONLY <= set(r), ROLLOUT_ONLY - set(r)
    assert not TRAINER_ONLY & set(r), TRAINER_ONLY & set(r)
    assert not ROLLOUT_ONLY & set(t), ROLLOUT_ONLY & set(t)


def test_one_generate_moves_latency_count_and_token_counters_by_its_size(services):
    _, rollout = services
    ep = {"role": "rollout", "endpoint": "grpc_generate"}
    fams = scrape(rollout.http.port)
    count0 = value(fams, "weightsync_generation_duration_seconds", "weightsync_generation_duration_seconds_count", **ep)
    prompt0 = value(fams, "weightsync_prompt_tokens", "weightsync_prompt_tokens_total", **ep)
    completion0 = value(fams, "weightsync_completion_tokens", "weightsync_completion_tokens_total", **ep)
    http0 = value(
        fams, "weightsync_prompt_tokens", "weightsync_prompt_tokens_total", role="rollout", endpoint="http_completions"
    )
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    with channel(rollout.grpc.address) as ch:
        resp = rollout_stub(ch, TOKEN, 60).Generate(
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts],
                sampling=rollout_pb2.SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=2),
            )
        )
    generated = sum(len(s.token_ids) for s in resp.samples)
    assert len(resp.samples) == 4 and generated > 0
    fams = scrape(rollout.http.port)
    assert (
        value(fams, "weightsync_generation_duration_seconds", "weightsync_generation_duration_seconds_count", **ep)
        == count0 + 1
    )
    assert value(fams, "weightsync_generation_duration_seconds", "weightsync_generation_duration_seconds_sum", **ep) > 0
    assert value(fams, "weightsync_prompt_tokens", "weightsync_prompt_tokens_total", **ep) == prompt0 + 8
    assert (
        value(fams, "weightsync_completion_tokens", "weightsync_completion_tokens_total", **ep)
        == completion0 + generated
    )
    assert (
        value(fams, "weightsync_generation_requests_in_flight", "weightsync_generation_requests_in_flight", **ep) == 0
    )
    assert (
        value(
            fams,
            "weightsync_prompt_tokens",
            "weightsync_prompt_tokens_total",
            role="rollout",
            endpoint="http_completions",
        )
        == http0
    )  # a gRPC request is not counted as HTTP
    # a refused request (no prompts) is no answer: it moves none of them
    import grpc

    with channel(rollout.grpc.address) as ch, pytest.raises(grpc.RpcError):
        rollout_stub(ch, TOKEN, 60).Generate(rollout_pb2.GenerateRequest())
    fams = scrape(rollout.http.port)
    assert (
        value(fams, "weightsync_generation_duration_seconds", "weightsync_generation_duration_seconds_count", **ep)
        == count0 + 1
    )
    assert (
        value(fams, "weightsync_generation_requests_in_flight", "weightsync_generation_requests_in_flight", **ep) == 0
    )


def test_an_http_completion_is_measured_under_its_endpoint(services):
    import json

    _, rollout = services
    ep = {"role": "rollout", "endpoint": "http_completions"}
    fams = scrape(rollout.http.port)
    count0 = value(fams, "weightsync_generation_duration_seconds", "weightsync_generation_duration_seconds_count", **ep)
    prompt0 = value(fams, "weightsync_prompt_tokens", "weightsync_prompt_tokens_total", **ep)
    completion0 = value(fams, "weightsync_completion_tokens", "weightsync_completion_tokens_total", **ep)
    body = json.dumps({"model": "tiny-qwen2", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{rollout.http.port}/v1/completions",
        data=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    fams = scrape(rollout.http.port)
    assert (
        value(fams, "weightsync_generation_duration_seconds", "weightsync_generation_duration_seconds_count", **ep)
        == count0 + 1
    )
    assert value(fams, "weightsync_prompt_tokens", "weightsync_prompt_tokens_total", **ep) == prompt0 + 3
    assert (
        value(fams, "weightsync_completion_tokens", "weightsync_completion_tokens_total", **ep)
        == completion0 + answer["usage"]["completion_tokens"]
    )
