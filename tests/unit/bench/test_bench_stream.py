"""bench/bench_stream.py runs against a real rollout and reads its streams right (the GPU run: tests/gpu)."""

from __future__ import annotations

from bench.bench_stream import measure
from tests.support.local_apps import start_rollout


def test_bench_stream_measures_a_rollout():
    app = start_rollout("bench-stream", serve_initial_weights=True)
    try:
        r = measure(app.http.port, prompts=2, n=2, max_tokens=8, reps=1)
    finally:
        app.stop()
    assert r["stream_equals_whole"], r
    assert 0 < r["stream_first_chunk_s"] <= r["stream_end_s"] and r["whole_s"] > 0, r
