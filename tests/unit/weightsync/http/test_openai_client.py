"""A rollout's OpenAI surface driven by the official `openai` client, as vLLM/SGLang users do.

Two rollouts: the shared `services` one (tiny-qwen2, no tokenizer: token ids only, a token
required) and one whose model directory has a byte-level tokenizer with a chat template. Every
answer is checked against gRPC Generate on the same token ids, and streams against the same
request without `stream`.
"""

from __future__ import annotations

import openai
import pytest

from tests.support.local_apps import start_rollout
from tests.unit.weightsync.http.rest_helpers import TOKEN, byte_level_model
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import rollout_pb2

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def _client(port: int, key: str = TOKEN):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


def _grpc_generate(rollout, prompts, token=TOKEN, **sampling):
    with channel(rollout.grpc.address) as ch:
        return rollout_stub(ch, token).Generate(
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts],
                return_logprobs=True,
                sampling=rollout_pb2.SamplingParams(**sampling),
            )
        )


@pytest.fixture(scope="module")
def chat_rollout(tmp_path_factory):
    """A rollout whose model directory has a byte-level tokenizer (every one of the model's 256 ids is
    a byte, so any generated id decodes, and multi-byte characters span tokens) and a chat template."""
    from transformers import AutoTokenizer

    path = byte_level_model(tmp_path_factory.mktemp("chat-model"), CHAT_TEMPLATE)
    app = start_rollout("chat", model=str(path), auth_token=TOKEN, serve_initial_weights=True)
    yield app, AutoTokenizer.from_pretrained(str(path), local_files_only=True), str(path)
    app.stop()


# ---- models -----------------------------------------------------------------------------------
def test_models_list_and_retrieve(services):
    _, rollout = services
    client = _client(rollout.http.port)
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-qwen2"] and models[0].object == "model"
    assert models[0].model_extra["weight_version"] == rollout.tx.version
    assert client.models.retrieve("tiny-qwen2").model_extra["weight_version"] == rollout.tx.version
    with pytest.raises(openai.NotFoundError, match="'other'.*tiny-qwen2"):
        client.models.retrieve("other")


# ---- completions ------------------------------------------------------------------------------
def test_completions_through_the_client_equal_grpc_generate(services):
    _, rollout = services
    client = _client(rollout.http.port)
    raw = client.completions.with_raw_response.create(
        model="tiny-qwen2", prompt=[[5, 6, 7], [9, 10]], max_tokens=6, temperature=0.7, n=2, seed=4, logprobs=1
    )
    out = raw.parse()
    ref = _grpc_generate(rollout, [[5, 6, 7], [9, 10]], max_new_tokens=6, temperature=0.7, n=2, seed=4)
    assert out.model_extra["weight_version"] == ref.version == int(raw.headers["X-Weight-Version"])
    assert [c.model_extra["token_ids"] for c in out.choices] == [list(s.token_ids) for s in ref.samples]
    assert [c.logprobs.token_logprobs for c in out.choices] == [list(s.logprobs) for s in ref.samples]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == sum(len(s.token_ids) for s in ref.samples)


def test_streamed_completions_are_the_same_answer(services):
    _, rollout = services
    client = _client(rollout.http.port)
    args = {
        "model": "tiny-qwen2",
        "prompt": [[3, 4], [8]],
        "max_tokens": 5,
        "temperature": 0.9,
        "n": 2,
        "seed": 9,
        "logprobs": 0,
    }
    whole = client.completions.create(**args)
    ids, lps, reasons, usage, versions = {}, {}, {}, None, set()
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        versions.add(chunk.model_extra["weight_version"])
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs if c.logprobs else [])
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert versions == {whole.model_extra["weight_version"]}
    assert [ids[i] for i in range(4)] == [c.model_extra["token_ids"] for c in whole.choices]
    assert [lps[i] for i in range(4)] == [c.logprobs.token_logprobs for c in whole.choices]
    assert [reasons[i] for i in range(4)] == [c.finish_reason for c in whole.choices]
    assert usage == whole.usage


def test_text_completions_stop_strings_and_echo(chat_rollout):
    app, hf, model = chat_rollout
    client = _client(app.http.port)
    args = {"model": model, "prompt": "the cat sat", "max_tokens": 24, "temperature": 1.0, "seed": 5}
    whole = client.completions.create(**args)
    ids = whole.choices[0].model_extra["token_ids"]
    ref = _grpc_generate(
        app, [hf.encode("the cat sat", add_special_tokens=False)], max_new_tokens=24, temperature=1.0, seed=5
    )
    assert ids == list(ref.samples[0].token_ids) and whole.choices[0].text == hf.decode(ids)
    # a stop string taken from the middle of that answer: the text ends before it, ids at its token
    text = whole.choices[0].text
    stop = next(ch for ch in text[len(text) // 3 :] if ch.isprintable() and ch != "\ufffd")
    cut = client.completions.create(**args, stop=[stop, "never-generated-\x01"])
    c = cut.choices[0]
    assert c.finish_reason == "stop" and c.text == text[: text.find(stop)] and stop not in c.text
    cut_ids = c.model_extra["token_ids"]
    assert cut_ids == ids[: len(cut_ids)] and stop in hf.decode(cut_ids) and stop not in hf.decode(cut_ids[:-1])
    assert cut.usage.completion_tokens == len(cut_ids)
    # streamed with the stop string: the same text, piece by piece
    pieces = [ch.choices[0].text for ch in client.completions.create(**args, stop=stop, stream=True) if ch.choices]
    assert "".join(pieces) == c.text
    echoed = client.completions.create(**args, echo=True)
    assert echoed.choices[0].text == "the cat sat" + text


# ---- chat -------------------------------------------------------------------------------------
def test_chat_applies_the_chat_template(chat_rollout):
    app, hf, model = chat_rollout
    client = _client(app.http.port)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo, wörld"}]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=12, temperature=0.8, seed=2, logprobs=True
    )
    out = raw.parse()
    prompt = hf.encode(
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    ref = _grpc_generate(app, [prompt], max_new_tokens=12, temperature=0.8, seed=2)
    c = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.model_extra["token_ids"] == list(ref.samples[0].token_ids)
    assert c.message.content == hf.decode(list(ref.samples[0].token_ids), skip_special_tokens=True)
    assert [t.logprob for t in c.logprobs.content] == list(ref.samples[0].logprobs)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 12
    assert out.model_extra["weight_version"] == ref.version == int(raw.headers["X-Weight-Version"])


def test_streamed_chat_is_the_same_answer(chat_rollout):
    app, _, model = chat_rollout
    client = _client(app.http.port)
    args = {
        "model": model,
        "messages": [{"role": "user", "content": "the cat sat"}],
        "max_completion_tokens": 20,
        "temperature": 1.0,
        "seed": 8,
        "n": 2,
    }
    whole = client.chat.completions.create(**args)
    content, roles, reasons, usage, pieces = {0: "", 1: ""}, {}, {}, None, 0
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            pieces += bool(c.delta.content)
            if c.delta.role:
                roles[c.index] = c.delta.role
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [content[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert roles == {0: "assistant", 1: "assistant"} and reasons == {0: "length", 1: "length"}
    assert usage == whole.usage
    assert pieces > 10, "the text came in one piece, not token by token"


def test_chat_without_a_tokenizer_is_a_clear_400(services):
    _, rollout = services
    with pytest.raises(openai.BadRequestError, match="tokenizer") as e:
        _client(rollout.http.port).chat.completions.create(
            model="tiny-qwen2", messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.param == "messages" and e.value.type == "invalid_request_error"


# ---- errors through the client ----------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logprobs": 9}, "logprobs"),
        ({"prompt": "text"}, "tokenizer"),
    ],
)
def test_client_reads_error_messages(services, kwargs, field):
    _, rollout = services
    args = {"model": "tiny-qwen2", "prompt": [1, 2], **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        _client(rollout.http.port).completions.create(**args)
    assert field in str(e.value) and e.value.status_code == 400, str(e.value)


def test_unknown_model_is_404_and_a_wrong_token_401(services):
    _, rollout = services
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        _client(rollout.http.port).completions.create(model="gpt-4", prompt=[1, 2])
    with pytest.raises(openai.AuthenticationError, match="token") as e:
        _client(rollout.http.port, key="wrong").completions.create(model="tiny-qwen2", prompt=[1, 2])
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(rollout.http.port, key="wrong").models.list()
