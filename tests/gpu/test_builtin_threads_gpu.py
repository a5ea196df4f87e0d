"""The built-in engine on a GPU decodes on any thread alike (the service runs each request on its own).

cuDNN attention caches an execution plan per shape and per thread, and a decode step's shape is new
at every token, so requests on worker threads rebuilt a plan at nearly every attention call (an
H200: 63 ms a token on a fresh thread against 17 on the main thread). The engine keeps attention
off cuDNN; bench/bench_builtin_concurrency.py measures the speed, these tests the setting and that
a request's tokens do not depend on the thread that ran it."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine():
    from transformers import Qwen2Config

    from rollout_svc.engine.builtin import BuiltinEngine

    cfg = Qwen2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    return BuiltinEngine.from_config(cfg, seed=3, dtype=torch.bfloat16, device="cuda:0")


def test_an_engine_on_the_gpu_turns_cudnn_attention_off():
    torch.backends.cuda.enable_cudnn_sdp(True)
    _engine()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_request_on_a_worker_thread_decodes_the_tokens_of_the_main_thread():
    from rollout_svc.engine.base import SamplingParams

    engine = _engine()
    sp = SamplingParams(max_new_tokens=24, temperature=0.0)
    prompt = [[5, 17, 99, 3, 250, 41, 7]]
    main = engine.generate(prompt, sp)[0]
    engine.flush_cache()
    got = []
    t = threading.Thread(target=lambda: got.append(engine.generate(prompt, sp)[0]))
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the worker thread's request did not finish in 120 s"
    assert got[0].token_ids == main.token_ids
    assert got[0].logprobs == pytest.approx(main.logprobs, abs=1e-3)
