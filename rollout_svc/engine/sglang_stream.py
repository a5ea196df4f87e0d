"""Token streaming on SGLang: `SglangEngine.generate(..., emit=f)` hands token ids to `f` as SGLang makes them.

SGLang's `Engine.generate(..., stream=True)` (0.5.10 and 0.5.23 alike) returns a plain generator that
runs each item with `Engine.loop.run_until_complete`; `Engine.loop` is the adapter's LoopThread
(sglang_loop.py), so each item is made on SGLang's loop thread while the calling thread waits for it, and
other calls' streams run at the same time. The adapter sends every (prompt, sample) request of a call in
that one batched call, as it does without streaming. Each
item is one request's output so far, named by `meta_info["id"]` (the rid we gave). The adapter keeps
`incremental_streaming_output` off (sglang_options.OWNED): `output_ids` and
`meta_info["output_token_logprobs"]` are then cumulative in both versions (with it on, 0.5.10 sends
delta ids beside cumulative log-probs and 0.5.23 slices both), and a backlog is coalesced into its
latest item, so one item may add several tokens. A request's last item has `meta_info["finish_reason"]`.

`emit` gets one token per call, a sample's tokens in order, so that a sample it ends (base.Emit: a stop
string completed, openai_api/stop_watch.py) ends exactly at the token that completed it, as on the
built-in engine. SGLang's own `stop` sampling param is not used: the engine runs with
skip_tokenizer_init (it has no tokenizer to match strings with), and SGLang's matching would run on its
own detokenised text, not the text our answer is cut on (openai_api/text.py), so the same request
could end at another token than on the built-in engine.

Ending requests early: `abort_request(rid)` is queued on Engine.loop (call_soon_threadsafe; it runs on
the loop's own thread, as SGLang's ZMQ socket needs).
SGLang then finishes the request (finish_reason type "abort") and frees its KV cache. The stream is
read to its end either way, so nothing stays running in SGLang's scheduler or pending in its
tokenizer manager. A sample emit ended keeps the tokens emit saw, never those SGLang made meanwhile.
Once `emit` raises (the stream's reader went away or stalled) or the service's cancellation check
does (`step`, asked by the cancel watcher every CANCEL_POLL_S), every request of the call is aborted,
emit is called no more, and that exception is raised once the stream has ended.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from rollout_svc.engine.base import Emit, SampleResult, TokenOut


@dataclass
class _Sample:
    """One SGLang request (one sample of one prompt) as its stream items arrive."""

    prompt_index: int
    sample: int  # its index among its prompt's n
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None  # "stop" / "length" once it ended
    hit: bool = False  # some of its prompt came from SGLang's radix cache
    cut: bool = False  # emit ended it: what SGLang sends after is dropped


def finish_kind(meta: dict) -> str | None:
    """The type of SGLang's finish_reason ("stop", "length", "abort"), None while the request runs."""
    reason = meta.get("finish_reason")
    if not reason:
        return None
    return reason.get("type", "length") if isinstance(reason, dict) else str(reason)


class SglangStreamMixin:
    """`_generate_streamed` for SglangEngine (which supplies _sgl, _abort and _aborting_on_cancel)."""

    def _generate_streamed(self, ids, params, owner: list[int], n: int, emit: Emit, step) -> list[SampleResult]:
        rids = [uuid.uuid4().hex for _ in ids]
        samples = {rid: _Sample(owner[k], k % n) for k, rid in enumerate(rids)}  # prompt-major: k % n
        failed: list[BaseException] = []
        with self._aborting_on_cancel(rids, step) as cancelled:
            try:
                # each item is waited for on this thread while SGLang's loop runs on its own (sglang_loop.py):
                # other requests' streams and calls go on meanwhile
                items = self._sgl.generate(
                    input_ids=ids, sampling_params=params, return_logprob=True, rid=rids, stream=True
                )
                for out in items:
                    rid = out["meta_info"]["id"]
                    if failed or cancelled:
                        continue  # every request was aborted: read the stream to its end
                    try:
                        if self._take(samples[rid], out, emit):
                            self._abort([rid])
                    except BaseException as exc:  # noqa: BLE001 — raised below, once SGLang is done
                        failed.append(exc)
                        self._abort(rids)
            except Exception:
                if not (failed or cancelled):
                    raise
                # SGLang may answer an aborted request with an error: the reason it was aborted wins
        if cancelled:
            raise cancelled[0]
        if failed:
            raise failed[0]
        unfinished = [s.prompt_index for s in samples.values() if s.reason is None]
        if unfinished:
            raise RuntimeError(f"sglang's stream ended before the requests of prompts {unfinished} finished")
        return [SampleResult(s.prompt_index, s.ids, s.logprobs, s.reason, s.hit) for s in samples.values()]

    @staticmethod
    def _take(s: _Sample, out: dict, emit: Emit) -> bool:
        """Emit the tokens `out` adds to `s`; True when emit ended it (its SGLang request must be aborted)."""
        if s.cut:
            return False  # ended by emit; this is what SGLang made before the abort landed
        meta = out["meta_info"]
        kind = finish_kind(meta)
        if kind == "abort":  # not ours (ours are cut or cancelled): e.g. SGLang ran out of memory
            raise RuntimeError(f"sglang aborted the request for prompt {s.prompt_index}: {meta.get('finish_reason')}")
        out_ids, rows = out["output_ids"], meta.get("output_token_logprobs") or []
        # an item's log-probs never trail its ids in SGLang 0.5.10/0.5.23; if they ever did, wait for them
        have = len(out_ids) if kind else min(len(out_ids), len(rows))
        if len(rows) < have:
            raise RuntimeError(
                f"sglang returned {len(rows)} log-probs for {have} tokens of prompt {s.prompt_index}'s sample"
            )
        s.hit = int(meta.get("cached_tokens") or 0) > 0
        reason = None if kind is None else ("stop" if kind == "stop" else "length")
        for j in range(len(s.ids), have):
            token, logprob = int(out_ids[j]), float(rows[j][0])
            s.ids.append(token)
            s.logprobs.append(logprob)
            last = reason if j == have - 1 else None
            ended = emit(s.prompt_index, [TokenOut(s.sample, token, logprob, last)])
            if last is None and s.sample in set(ended or ()):
                s.reason, s.cut = "stop", True
                return True
        if reason is not None:
            s.reason = reason
        return False
