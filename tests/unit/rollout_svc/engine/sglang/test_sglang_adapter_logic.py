"""The adapter's own logic, on CPU, without sglang.

SGLang cannot run here, so `_Recorder` stands in for `sglang.srt.entrypoints.engine.Engine` at
that boundary only: it records the calls the adapter makes (names and keywords are checked
against the real sglang source by test_sglang_contract.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

from rollout_svc.engine.base import SamplingParams
from rollout_svc.engine.sglang_engine import SglangEngine, SglangOptions, _sampling_params_dict
from rollout_svc.engine.sglang_weights import SglangUpdateError, UpdateGroup, check_result, dense_layout_error
from weightsync.bus.plan import TensorMeta, plan_buckets


class _Recorder:
    def __init__(self, result=(True, "Success")):
        self.calls: list[tuple[str, dict]] = []
        self.result = result

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, kwargs))
            return self.result

        return call


def _engine(tp: int = 1, result=(True, "Success"), **opts) -> SglangEngine:
    eng = SglangEngine.__new__(SglangEngine)  # skip _start: no sglang here
    eng.opts = SglangOptions(model_path="/m", tp_size=tp, **opts)
    eng.tp_size, eng._metas, eng._update_group = tp, {}, ""
    eng._sgl = _Recorder(result)
    return eng


def test_module_import_does_not_import_sglang():
    assert not [m for m in sys.modules if m.split(".")[0] == "sglang"]


def test_sampling_params_mapping():
    s = SamplingParams(max_new_tokens=7, temperature=0.0, top_p=0.9, top_k=0, stop_token_ids=(2, 3), n=4)
    assert _sampling_params_dict(s, None) == dict(
        max_new_tokens=7, temperature=0.0, top_p=0.9, stop_token_ids=[2, 3], n=1
    )
    d = _sampling_params_dict(SamplingParams(top_k=5), 11)
    assert d["top_k"] == 5 and d["sampling_seed"] == 11


def test_generate_expands_samples_prompt_major():
    eng = _engine(deterministic=True)
    outs = [
        {
            "output_ids": [10 + k],
            "meta_info": {
                "finish_reason": {"type": "stop" if k % 2 else "length"},
                "output_token_logprobs": [(-0.5, 10 + k, None)],
            },
        }
        for k in range(6)
    ]
    eng._sgl.result = outs
    res = eng.generate([[1, 2], [3], [4, 5, 6]], SamplingParams(n=2, seed=100))
    name, kw = eng._sgl.calls[0]
    assert name == "generate" and kw["input_ids"] == [[1, 2], [1, 2], [3], [3], [4, 5, 6], [4, 5, 6]]
    assert [p["sampling_seed"] for p in kw["sampling_params"]] == [100, 101, 102, 103, 104, 105]
    assert [r.prompt_index for r in res] == [0, 0, 1, 1, 2, 2]
    assert res[1].finish_reason == "stop" and res[0].logprobs == [-0.5]


def test_generate_reports_radix_cache_hits():
    # found writing the live GPU check (bench/sglang_live.py): every SGLang sample said prefix_cache_hit=False, so
    # neither the rollout's prefix-hit metric nor a check that a sync flushed the radix cache could work
    eng = _engine()
    eng._sgl.result = [
        {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}, "cached_tokens": n}} for n in (0, 5)
    ]
    res = eng.generate([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]], SamplingParams())
    assert [r.prefix_cache_hit for r in res] == [False, True]


def test_generate_refuses_aborted_output():
    eng = _engine()
    eng._sgl.result = [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}}]
    with pytest.raises(RuntimeError, match="aborted"):
        eng.generate([[1]], SamplingParams())


def test_check_result_shapes():
    check_result((True, "ok"), "x")
    check_result(None, "x")
    with pytest.raises(SglangUpdateError, match="boom"):
        check_result((False, "boom"), "update")
    with pytest.raises(SglangUpdateError):
        check_result(type("R", (), {"success": False, "message": ""})(), "flush_cache")


def _metas(*specs):
    return [TensorMeta(n, s, d) for n, s, d in specs]


def test_distributed_receive_needs_a_dense_plan():
    # Tensors whose sizes are multiples of the 256-B plan alignment leave no padding: dense.
    dense = plan_buckets(_metas(("a", (128,), torch.bfloat16), ("b", (32, 4), torch.float32)), 1 << 20)[0]
    assert dense_layout_error(dense) is None
    # A 6-byte tensor makes the plan pad to 256 before the next one: SGLang would misread it.
    padded = plan_buckets(_metas(("a", (3,), torch.bfloat16), ("b", (4,), torch.float32)), 1 << 20)[0]
    assert "densely" in dense_layout_error(padded)


def test_receive_bucket_distributed_calls_flattened_update():
    eng = _engine(tp=2)
    with pytest.raises(SglangUpdateError, match="join_update_group"):
        eng.receive_bucket_distributed(plan_buckets(_metas(("a", (128,), torch.bfloat16)), 1 << 20)[0])
    eng.join_update_group(UpdateGroup("10.0.0.1", 29500, rank_offset=1, world_size=3, group_name="ws-g1"))
    plan = plan_buckets(_metas(("w", (128, 2), torch.bfloat16), ("v", (64,), torch.float32)), 1 << 20)[0]
    eng.receive_bucket_distributed(plan)
    name, kw = eng._sgl.calls[-1]
    assert name == "update_weights_from_distributed"
    assert kw == dict(
        names=["w", "v"],
        dtypes=["bfloat16", "float32"],
        shapes=[[128, 2], [64]],
        group_name="ws-g1",
        flush_cache=False,
        load_format="flattened_bucket",
    )
    assert eng._sgl.calls[0] == (
        "init_weights_update_group",
        dict(
            master_address="10.0.0.1",
            master_port=29500,
            rank_offset=1,
            world_size=3,
            group_name="ws-g1",
            backend="nccl",
        ),
    )


def test_failed_update_raises():
    eng = _engine(result=(False, "Failed to update parameter online"))
    with pytest.raises(SglangUpdateError, match="online"):
        eng.load_weights([("a", torch.zeros(2))])


def test_cpu_tensors_go_as_named_list_without_cache_flush():
    eng = _engine()
    t = torch.ones(3)
    eng.load_weights([("a", t)])
    name, kw = eng._sgl.calls[0]
    assert name == "update_weights_from_tensor" and kw["flush_cache"] is False and kw["named_tensors"][0][0] == "a"


def test_load_weights_is_chunked(monkeypatch):
    from rollout_svc.engine import sglang_weights

    monkeypatch.setattr(sglang_weights, "LOAD_CHUNK_BYTES", 64)
    eng = _engine()
    eng.load_weights([(f"t{i}", torch.zeros(8)) for i in range(5)])  # 32 B each -> 2 + 2 + 1
    assert [len(kw["named_tensors"]) for _, kw in eng._sgl.calls] == [2, 2, 1]


class _SlowSgl:
    """Engine.generate that runs until its requests are aborted (on Engine.loop, as SGLang wants)."""

    def __init__(self):
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.aborted: list[str] = []
        self.started = threading.Event()
        sgl = self

        class _TM:
            def abort_request(self, rid):
                assert threading.current_thread() is sgl.loop_thread, "abort_request must run on Engine.loop"
                sgl.aborted.append(rid)

        self.tokenizer_manager = _TM()
        self.loop_thread = None

    def generate(self, input_ids, sampling_params, return_logprob, rid):
        import asyncio
        import threading

        self.loop_thread = threading.current_thread()
        self.started.set()

        async def run():
            while set(rid) - set(self.aborted):
                await asyncio.sleep(0.01)
            return [{"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort"}}} for _ in rid]

        return self.loop.run_until_complete(asyncio.wait_for(run(), 10))


def test_a_cancelled_generate_aborts_every_request_on_sglangs_loop_and_raises_the_cancellation():
    import time

    eng = _engine()
    eng._sgl = sgl = _SlowSgl()
    cancel_at = time.monotonic() + 0.3

    class Cancelled(Exception):
        pass

    def step():
        if time.monotonic() > cancel_at:
            raise Cancelled("client went away")

    t0 = time.monotonic()
    with pytest.raises(Cancelled, match="client went away"):
        eng.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=32768), step=step)
    assert time.monotonic() - t0 < 2.0
    assert len(sgl.aborted) == 4 and len(set(sgl.aborted)) == 4  # one rid per (prompt, sample), all aborted


def test_generate_without_step_passes_one_request_id_per_sample():
    eng = _engine()
    eng._sgl.result = [
        {
            "output_ids": [7],
            "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.1, 7, None)]},
        }
    ] * 2
    eng.generate([[1]], SamplingParams(n=2))
    name, kw = eng._sgl.calls[0]
    assert name == "generate" and len(kw["rid"]) == 2 and len(set(kw["rid"])) == 2


def test_a_bucket_mapped_from_another_process_is_copied_before_it_is_handed_to_sglang(monkeypatch):
    # Found on an H100 (bench/sglang_live.py, colocated ipc): rollout-svc maps the trainer's CUDA IPC
    # handle, and torch refuses to pickle that imported storage again for SGLang ("Attempted to send
    # CUDA tensor received from another process"), so every colocated sync aborted. torch's check is
    # CUDA-only (StorageSharing.cpp): simulated here by refusing the mapped buffer's storage.
    from rollout_svc.engine import sglang_weights

    eng = _engine()
    plan = plan_buckets([TensorMeta("w", (4,), torch.float32)], bucket_bytes=1 << 20)[0]
    mapped = torch.arange(plan.nbytes // 4, dtype=torch.float32).view(torch.uint8)
    sent = []

    def payload(flat, slots):
        if flat.untyped_storage().data_ptr() == mapped.untyped_storage().data_ptr():
            raise RuntimeError(
                "Attempted to send CUDA tensor received from another process; this is not currently "
                "supported. Consider cloning before sending."
            )
        sent.append(flat.clone())
        return b"payload"

    monkeypatch.setattr(eng, "_payload", payload)
    assert eng.bucket_payloads(plan, mapped) == [b"payload"]
    assert torch.equal(sent[0], mapped[: plan.nbytes])
    assert sglang_weights.RESHARE_REFUSED in "Attempted to send CUDA tensor received from another process"
    # any other serialisation error still surfaces
    monkeypatch.setattr(eng, "_payload", lambda flat, slots: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):
        eng.bucket_payloads(plan, mapped)


def test_buckets_are_received_on_the_receive_ranks_gpu_and_the_rank_must_exist():
    from rollout_svc.config import ConfigError, InferenceConfig

    eng = SglangEngine.__new__(SglangEngine)
    eng.opts = SglangOptions(model_path="/m", tp_size=2, base_gpu_id=1)
    assert eng.receive_device() == torch.device("cuda", 1)  # the first rank's GPU: a colocated trainer's for ipc
    eng.opts = SglangOptions(model_path="/m", tp_size=2, base_gpu_id=1, receive_rank=1)
    assert eng.receive_device() == torch.device("cuda", 2)
    with pytest.raises(ConfigError, match="receive_rank=2 must be a TP rank"):
        InferenceConfig(engine="sglang", tp=2, receive_rank=2).validate()
