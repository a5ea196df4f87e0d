"""Time to the first streamed token vs. the whole answer, on a rollout's OpenAI /v1/completions.

The built-in engine streams tokens as it decodes them, so a stream's first chunk should come after
the prefill and one decode step, not after the whole generation; its last chunk about when the
non-streamed answer comes (the per-token chunks are the overhead). Against any rollout's HTTP port,
or one started in this process (the built-in engine on `--device`):

    python -m bench stream --port 8091 --token-file token --n 4 --max-tokens 256
    python -m bench stream --model tiny-qwen2 --device cuda:0 --n 4 --max-tokens 256

It prints one JSON object: medians over `--reps` of the non-streamed answer's latency, the
stream's first chunk and its end, their ratios, and whether the stream joined to the same ids.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time


def _post(port: int, token: str, body: dict, stream: bool):
    """(seconds to the first chunk or the answer, seconds to the end, ids per choice index)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        if not stream:
            out = json.loads(resp.read())
            t = time.perf_counter() - t0
            return t, t, {c["index"]: c["token_ids"] for c in out["choices"]}
        first, ids = None, {}
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']['message']}")
            for c in chunk["choices"]:
                if c["token_ids"] and first is None:
                    first = time.perf_counter() - t0
                ids.setdefault(c["index"], []).extend(c["token_ids"])
        return first, time.perf_counter() - t0, ids
    finally:
        conn.close()


def measure(port: int, token: str = "", prompts: int = 1, n: int = 4, max_tokens: int = 256, reps: int = 5) -> dict:
    body = {
        "prompt": [[(i * 7 + j) % 200 + 1 for j in range(16)] for i in range(prompts)],
        "max_tokens": max_tokens,
        "n": n,
        "temperature": 1.0,
        "seed": 1,
    }
    _post(port, token, body, False)  # warm-up
    whole, first, end, exact = [], [], [], True
    for _ in range(reps):  # alternated, so a machine that gets busier tilts both alike
        t, _, ref = _post(port, token, body, False)
        whole.append(t)
        f, e, ids = _post(port, token, body, True)
        first.append(f)
        end.append(e)
        exact &= ids == ref
    w, f, e = (statistics.median(x) for x in (whole, first, end))
    return {
        "prompts": prompts,
        "n": n,
        "max_tokens": max_tokens,
        "reps": reps,
        "whole_s": w,
        "stream_first_chunk_s": f,
        "stream_end_s": e,
        "first_chunk_over_whole": f / w,
        "stream_end_over_whole": e / w,
        "stream_equals_whole": exact,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, help="a running rollout's HTTP port (127.0.0.1)")
    p.add_argument("--token-file", default="", help="the rollout's auth token file, if it has one")
    p.add_argument("--model", default="tiny-qwen2", help="without --port: the model of a rollout started here")
    p.add_argument("--device", default="cpu", help="without --port: the built-in engine's device (cuda:0, ...)")
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    a = p.parse_args(argv)
    token = open(a.token_file).read().strip() if a.token_file else ""
    app = None
    if a.port is None:
        from rollout_svc.app import RolloutApp
        from rollout_svc.config import RolloutConfig

        app = RolloutApp(
            RolloutConfig.from_flat(
                rollout_id="bench-stream",
                grpc_address="127.0.0.1:0",
                http_address="127.0.0.1:0",
                model=a.model,
                device=a.device,
                serve_initial_weights=True,
            )
        )
        app.start()
    try:
        port = a.port if app is None else app.http.port
        r = measure(port, token, a.prompts, a.n, a.max_tokens, a.reps)
    finally:
        if app is not None:
            app.stop()
    print(json.dumps(r, indent=2))
    from bench.common.results import write_result

    baseline = {"what": "the same request not streamed, alternating", "rows_key": "whole_s"}
    where = f"port {a.port}" if a.port is not None else f"built-in engine on {a.device}"
    write_result("stream", [r], baseline=baseline, out=a.out or None, rollout=where, model=a.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
