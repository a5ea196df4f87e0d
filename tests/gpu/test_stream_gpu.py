"""Token streaming on a GPU: the first chunk of a stream comes long before the whole answer.

The built-in engine on cuda:0 with a ~10 M parameter Qwen2 (tests/support/paced_model.py), 224 new
tokens for 4 samples: the first chunk waits for the prefill and one decode step, the non-streamed
answer for all 224 (16 + 224 fit its 256 positions). The same measurement against any rollout:
python -m bench.bench_stream --port <rollout http port> (or --model <dir> --device cuda:0).
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.bench_stream import measure
from tests.support.local_apps import start_rollout
from tests.support.paced_model import paced_model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_first_streamed_chunk_comes_long_before_the_whole_answer(tmp_path):
    app = start_rollout("stream-gpu", model=paced_model(tmp_path), device="cuda:0", serve_initial_weights=True)
    try:
        r = measure(app.http.port, prompts=1, n=4, max_tokens=224, reps=5)
    finally:
        app.stop()
    print("\n" + json.dumps(r, indent=2))
    assert r["stream_equals_whole"], r
    assert r["first_chunk_over_whole"] < 0.1, r  # 2 of 225 forward passes, plus the HTTP round trip
    assert r["stream_end_over_whole"] < 2.0, r  # the per-token chunks cost less than the decoding
