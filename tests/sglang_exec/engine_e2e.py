"""SGLang's real `Engine` on CPU (scheduler subprocess, ZMQ, torch-native attention) behind our
adapter: generate, a sync through the adapter's weight paths, generate and score again, each
against transformers on the same weights. Run as `python -m tests.sglang_exec.engine_e2e <version>`
(test_sglang_engine_cpu.py does, when WEIGHTSYNC_SGLANG_ENGINE_E2E=1).

SGLang's scheduler is a spawned subprocess that re-imports this module as __mp_main__, so the
activation below runs at import time in both processes (and only when run as a program).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

if __name__ in ("__main__", "__mp_main__"):
    if __name__ == "__main__":
        os.environ["WS_SGLANG_E2E_VERSION"] = sys.argv[1]  # inherited by SGLang's subprocesses
    from tests.support.sglang_site import activate

    activate(os.environ["WS_SGLANG_E2E_VERSION"], engine=True)

import torch  # noqa: E402

PROMPTS = [[5, 17, 42, 7, 99, 3], [11, 2, 250, 64]]
N_NEW = 6


def _hf_model(cfg, state: dict):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    m.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        m.tie_weights()
    return m


def _hf_greedy(m, ids):
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def _hf_logprobs(m, ids, start):
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(start, len(ids))]


def tm_requests(sgl) -> set[str]:
    """The request ids SGLang's tokenizer manager holds state for (both versions), read from another thread."""
    while True:
        try:
            return set(sgl.tokenizer_manager.rid_to_state)
        except RuntimeError:  # changed size while read: SGLang's loop thread runs on
            continue


def main() -> dict:
    from rollout_svc.engine.base import SamplingParams
    from rollout_svc.engine.sglang_engine import SglangEngine, SglangOptions, _hf_param_metas, drive_loop
    from tests.sglang_exec.exec_checks import packed_buckets
    from trainer_svc.actor.hf.actor import HfActor
    from weightsync.models import resolve_model

    results = {}
    cfg, _ = resolve_model("tiny-qwen2")
    start = HfActor(cfg, seed=11)
    model_dir = tempfile.mkdtemp(prefix="ws-sglang-e2e-")
    start.model.save_pretrained(model_dir)

    from sglang.srt.entrypoints.engine import Engine

    from rollout_svc.engine.sglang_loader import LOADER

    sgl = Engine(
        model_path=model_dir,
        device="cpu",
        attention_backend="torch_native",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        mem_fraction_static=0.05,
        max_total_tokens=1024,
        dtype="float32",
        random_seed=0,
        log_level="error",
        custom_weight_loader=[LOADER],  # as SglangEngine._start registers it
    )
    try:
        import threading

        eng = SglangEngine.__new__(SglangEngine)  # SglangOptions has no CPU device/attention backend yet
        eng.opts = SglangOptions(model_path=model_dir, dtype="float32")
        eng.tp_size, eng._update_group, eng._sgl = 1, "", sgl
        drive_loop(sgl)  # as SglangEngine.__init__: SGLang's loop on its own thread (sglang_loop.py)
        eng._metas, eng._hf_config = _hf_param_metas(cfg, torch.float32), cfg

        def agree(tag, state):
            hf = _hf_model(cfg, state)
            got = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, temperature=0.0))]
            want = [_hf_greedy(hf, p) for p in PROMPTS]
            assert got == want, f"{tag}: SGLang greedy {got} != transformers {want}"
            lps, _ = eng.score(PROMPTS[0], 1)
            ref = _hf_logprobs(hf, PROMPTS[0], 1)
            err = max(abs(a - b) for a, b in zip(lps, ref))
            assert len(lps) == len(ref) and err < 1e-4, f"{tag}: score log-probs differ by {err} ({lps} vs {ref})"
            return err

        def run(name, fn):
            try:
                results[name] = f"ok ({fn()})"
            except Exception:
                results[name] = traceback.format_exc(limit=-8)

        run("generate_and_score_before_sync", lambda: agree("before", dict(start.model.state_dict())))

        def cancel():
            """A request whose client goes away stops in SGLang's scheduler, and the engine serves on."""
            import time

            class ClientGone(Exception):
                pass

            t0 = time.monotonic()

            def step():
                if time.monotonic() - t0 > 0.2:
                    raise ClientGone()

            # 8 x (4 + 500) tokens: the model's 512 positions, and 4 times the engine's 1024-token KV
            # pool, so SGLang runs the samples two by two; the tiny config's EOS id lies outside its
            # vocabulary, so nothing stops early
            long = SamplingParams(max_new_tokens=500, temperature=1.0, n=8)
            try:
                res = eng.generate(PROMPTS[1:], long, step=step)
                raise AssertionError(
                    f"finished before the cancellation after {time.monotonic() - t0:.2f}s "
                    f"({[len(r.token_ids) for r in res]} tokens)"
                )
            except ClientGone:
                stopped = time.monotonic() - t0
            assert stopped < 1.0, f"the cancelled request ran {stopped:.2f}s (cancelled at 0.2s)"
            t1 = time.monotonic()
            eng.generate(PROMPTS[1:], long)  # how long the whole request takes, for the record
            full = time.monotonic() - t1
            agree("after a cancelled request", dict(start.model.state_dict()))
            assert full > 2 * stopped, f"uncancelled, the request took {full:.2f}s: too short to tell"
            return f"stopped {stopped:.2f}s after start (cancelled at 0.2s); uncancelled it takes {full:.2f}s"

        run("generate_cancelled", cancel)

        def streamed():
            """generate(emit=) through SGLang's streaming generate: emit sees every token, one per call, and
            the answer is the non-streamed one; a sample emit ends (a stop string) is aborted at that token."""
            greedy = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
            whole = eng.generate(PROMPTS, greedy)
            seen: dict[int, list[int]] = {}

            def emit(pi, toks):
                assert len(toks) == 1, toks
                seen.setdefault(pi, []).append(toks[0].token_id)

            got = eng.generate(PROMPTS, greedy, emit=emit)
            assert [r.token_ids for r in got] == [r.token_ids for r in whole], (got, whole)
            assert [seen[i] for i in range(len(PROMPTS))] == [r.token_ids for r in whole], seen
            streamed_n = sum(map(len, seen.values()))

            def stop_second(pi, toks):
                seen[pi] = seen.get(pi, []) + [t.token_id for t in toks]
                return [0] if pi == 0 and len(seen[pi]) == 2 else None

            seen.clear()
            tm, aborted = sgl.tokenizer_manager, []
            # SGLang 0.5.10 keeps the state of requests aborted while queued (the `cancel` check's): only new ones count
            before = set(tm.rid_to_state)
            abort_request = tm.abort_request

            def recorded_abort(rid="", abort_all=False):
                aborted.append(rid)
                return abort_request(rid=rid, abort_all=abort_all)

            tm.abort_request = recorded_abort
            try:
                cut = eng.generate(PROMPTS, greedy, emit=stop_second)
            finally:
                del tm.abort_request
            assert (cut[0].token_ids, cut[0].finish_reason) == (whole[0].token_ids[:2], "stop"), cut[0]
            assert [r.token_ids for r in cut[1:]] == [r.token_ids for r in whole[1:]]
            assert len(aborted) == 1, aborted  # prompt 0's request only
            left = set(tm.rid_to_state) - before
            assert not left, left  # the stream was read to its end: nothing of it left in SGLang

            class ReaderGone(Exception):
                pass

            calls = []

            def gone_at_20(pi, toks):  # the stream's reader goes away at the 20th token
                calls.append(pi)
                if len(calls) == 20:
                    raise ReaderGone()

            import time

            t0 = time.monotonic()
            try:  # the long request of `cancel` above: 8 x 500 tokens
                eng.generate(PROMPTS[1:], SamplingParams(max_new_tokens=500, temperature=1.0, n=8), emit=gone_at_20)
                raise AssertionError("an emit that raised did not stop the request")
            except ReaderGone:
                gone_s = time.monotonic() - t0
            assert len(calls) == 20, len(calls)
            left = {r: tm.rid_to_state[r].finished for r in set(tm.rid_to_state) - before}
            agree("after streamed requests ended early", dict(start.model.state_dict()))
            return (
                f"{streamed_n} tokens emitted one by one; with prompt 0 ended at its 2nd token: "
                f"{sum(map(len, seen.values()))} emitted, its request aborted, no request state left in SGLang; "
                f"8 x 500 tokens whose reader went away at token 20 ended {gone_s:.2f}s after start, "
                f"leaving {len(left)} request states in SGLang ({sum(left.values())} finished)"
            )

        run("generate_streamed", streamed)

        def concurrent():
            """Two threads call generate at once: the short call ends while the long one (2 x 500 tokens, seconds)
            still runs in SGLang's scheduler beside it (with one call at a time it would wait for the long one),
            and both answers are those of the same calls made alone."""
            import time

            greedy = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
            alone = eng.generate(PROMPTS, greedy)
            long = SamplingParams(max_new_tokens=500, temperature=0.0, n=2)
            long_alone = eng.generate(PROMPTS[1:], long)
            out, long_done = {}, threading.Event()
            before = tm_requests(sgl)  # 0.5.10 keeps the state of requests aborted while queued (checks above)

            def run_long():
                try:
                    out["long"] = eng.generate(PROMPTS[1:], long)
                finally:
                    long_done.set()

            t0 = time.monotonic()
            threading.Thread(target=run_long, daemon=True).start()
            while not tm_requests(sgl) - before:  # the long call is in SGLang
                assert time.monotonic() - t0 < 30, "the long call never reached SGLang"
                time.sleep(0.005)
            short = eng.generate(PROMPTS, greedy)
            short_s = time.monotonic() - t0
            assert not long_done.is_set(), (
                f"the long call ended before the short one ({short_s:.2f}s): too short to tell"
            )
            assert long_done.wait(300), "the long call never ended"
            long_s = time.monotonic() - t0
            assert [r.token_ids for r in short] == [r.token_ids for r in alone], (short, alone)
            assert [r.token_ids for r in out["long"]] == [r.token_ids for r in long_alone]
            return f"a short call ended {short_s:.2f}s after a long one started, which ran {long_s:.2f}s"

        run("generate_concurrent", concurrent)

        def sync(seed, flattened):
            trainer = HfActor(cfg, seed=seed)
            named = list(trainer.export_tensors())
            eng.begin_apply()
            for plan, buf in packed_buckets(named, bucket_bytes=64 << 10):
                if flattened:  # load_bucket's CUDA branch (one flattened bucket), from CPU shared memory
                    eng._send_flattened(eng.bucket_payloads(plan, buf))
                else:  # load_bucket's CPU branch (named tensors)
                    eng.load_bucket(plan, buf)
            eng.end_apply()
            return agree(f"after sync seed={seed}", dict(trainer.model.state_dict()))

        run("sync_named_cpu_path", lambda: sync(22, flattened=False))
        run("sync_flattened_bucket_path", lambda: sync(33, flattened=True))
        run("sync_our_loader_then_export", lambda: sync_our_loader(eng, cfg, agree))
    finally:
        sgl.shutdown()
    return results


def sync_our_loader(eng, cfg, agree) -> str:
    """Two syncs through our loader in SGLang's real scheduler process (sglang_loader.py: the first learns the
    slot tables, the second is written by them), the buckets and result rows in shared CPU memory; at the end of
    the first, the export call (sglang_export.py) reaches the worker, which cannot share CPU storage by CUDA IPC:
    it reports the failure, the sync still commits, and no table is offered."""
    from rollout_svc.engine import sglang_loader as sl
    from tests.sglang_exec.exec_checks import packed_buckets
    from trainer_svc.actor.hf.actor import HfActor
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.plan import TensorMeta, make_manifest

    eng.direct_cpu = True
    eng._direct_rows = [torch.zeros(16, sl.RESULT_WORDS, dtype=torch.int64).share_memory_()]
    try:
        for seed, want in ((44, sl.LEARNED), (55, sl.BY_TABLE)):
            trainer = HfActor(cfg, seed=seed)
            named = list(trainer.export_tensors())
            buckets = packed_buckets(named, bucket_bytes=64 << 10)
            eng.begin_apply()
            for plan, buf in buckets:
                assert eng.load_bucket_summed(plan, buf) == bucket_checksum(buf[: plan.nbytes]), plan.index
            eng.end_apply()
            assert set(eng.direct_how.values()) == {want}, eng.direct_how
            assert ("export" in eng.apply_ms) == (seed == 44), eng.apply_ms  # asked once, at the learning sync
            agree(f"after our loader's sync seed={seed}", dict(trainer.model.state_dict()))
        metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
        m = make_manifest(metas, version=1, sync_id="s", bucket_bytes=64 << 10)
        assert eng.ipc_destinations(m) is None, "a table was offered though the worker could not share CPU storage"
        return f"{len(buckets)} buckets a sync"
    finally:
        eng.direct_cpu = False


if __name__ == "__main__":
    from tests.support.sglang_site import RESULT_MARK

    print(RESULT_MARK + json.dumps(main()), flush=True)
