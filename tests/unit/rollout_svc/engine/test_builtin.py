"""BuiltinEngine against the plain transformers model it wraps (same weights, no cache)."""

from __future__ import annotations

import pytest
import torch

from rollout_svc.engine.base import SamplingParams
from rollout_svc.engine.builtin import BuiltinEngine
from tests.support.counting_model import counting
from tests.unit.rollout_svc.engine.conftest import CONFIGS, qwen2_config

PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 7]]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Full recompute every step: the ground truth the KV-cached loop must reproduce."""
    ids, lps = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        tok = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt) :], lps


def greedy(n: int = 1, steps: int = 12) -> SamplingParams:
    return SamplingParams(max_new_tokens=steps, temperature=0.0, n=n)


def test_greedy_matches_uncached_reference(engine):
    out = engine.generate(PROMPTS, greedy(n=2))
    assert [r.prompt_index for r in out] == [0, 0, 1, 1]
    for r in out:
        want_toks, want_lps = reference_greedy(engine.model, PROMPTS[r.prompt_index], 12)
        assert r.token_ids == want_toks
        assert r.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(r.logprobs, want_lps)) <= 1e-5


def test_score_logits_equal_model_forward(engine):
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    lps, last = engine.score(ids, prompt_length=3)
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0].float()
    assert last.dtype == torch.float32 and torch.equal(last, logits[-1])
    want = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0][2:]
    assert len(lps) == len(ids) - 3 and torch.equal(torch.tensor(lps), want)


def test_stop_token_finishes_with_stop(qwen):
    first = qwen.generate([PROMPTS[0]], greedy(steps=8))[0].token_ids
    stop = first[3]
    r = qwen.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert r.finish_reason == "stop" and r.token_ids == first[: first.index(stop) + 1]


def test_emitted_tokens_are_the_results_step_by_step(qwen):
    """`emit` gets each step's tokens before the next step runs: per sample they join to its result,
    the last one carries the finish_reason, and the results are those of a generate without emit."""
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, n=3)
    plain = qwen.generate(PROMPTS, sp)
    stop = plain[1].token_ids[4]  # sample 1 of prompt 0 stops early, the others may too
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, n=3, stop_token_ids=(stop,))
    plain = qwen.generate(PROMPTS, sp)
    steps, order = [], []

    def emit(pi, toks):
        order.append("emit")
        steps.append((pi, toks))

    out = qwen.generate(PROMPTS, sp, step=lambda: order.append("step"), emit=emit)
    assert order[:5] == ["step", "emit", "step", "emit", "step"]  # prefill, token 1, decode, token 2, ...
    assert [(r.token_ids, r.logprobs, r.finish_reason) for r in out] == [
        (r.token_ids, r.logprobs, r.finish_reason) for r in plain
    ]
    assert plain[1].finish_reason == "stop" and len(plain[1].token_ids) == 5
    got: dict = {}
    for pi, toks in steps:
        assert len({t.sample for t in toks}) == len(toks)  # one token per sample and step
        for t in toks:
            ids, lps, reasons = got.setdefault(pi * 3 + t.sample, ([], [], []))
            assert not reasons or reasons[-1] is None, "a token after the sample's last one"
            ids.append(t.token_id), lps.append(t.logprob), reasons.append(t.finish_reason)
    for k, r in enumerate(plain):
        ids, lps, reasons = got[k]
        assert (ids, lps) == (r.token_ids, r.logprobs) and reasons == [None] * (len(ids) - 1) + [r.finish_reason]


def test_samples_emit_ends_decode_no_further_and_the_others_are_unchanged(qwen):
    """emit's answer (base.Emit): a sample it names ends with the token just emitted (finish_reason
    "stop"); the others get exactly their tokens; once all are done no further step is decoded."""
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, n=2)
    with counting(qwen) as plain_steps:
        plain = qwen.generate([PROMPTS[0]], sp)
    # the prefill samples the first token, each decode step one more; the 10th needs no forward after it
    assert [len(r.token_ids) for r in plain] == [10, 10] and plain_steps.decode_steps == 9

    def ending(at: dict[int, int]):
        """emit ending sample s after its at[s]-th token; records what each sample was sent."""
        sent: dict[int, list[int]] = {0: [], 1: []}

        def emit(pi, toks):
            for t in toks:
                sent[t.sample].append(t.token_id)
                assert t.finish_reason in (None, "length")  # no stop token in the vocabulary's use here
            return [s for s, k in at.items() if len(sent[s]) == k]

        return emit, sent

    # sample 0 ends after 3 tokens, sample 1 runs to length: no step is saved, sample 1 is unchanged
    emit, sent = ending({0: 3})
    with counting(qwen) as steps:
        out = qwen.generate([PROMPTS[0]], sp, emit=emit)
    assert (out[0].token_ids, out[0].logprobs) == (plain[0].token_ids[:3], plain[0].logprobs[:3])
    assert out[0].finish_reason == "stop" and sent[0] == out[0].token_ids  # nothing emitted after its end
    assert (out[1].token_ids, out[1].logprobs, out[1].finish_reason) == (
        plain[1].token_ids,
        plain[1].logprobs,
        plain[1].finish_reason,
    )
    assert steps.decode_steps == plain_steps.decode_steps
    # both end early: decoding stops after the 5th token (4 decode steps after the prefill's token)
    emit, sent = ending({0: 3, 1: 5})
    with counting(qwen) as steps:
        out = qwen.generate([PROMPTS[0]], sp, emit=emit)
    assert [r.token_ids for r in out] == [plain[0].token_ids[:3], plain[1].token_ids[:5]]
    assert [r.finish_reason for r in out] == ["stop", "stop"] and steps.decode_steps == 4
    # None (or nothing) ends nothing
    with counting(qwen) as steps:
        out = qwen.generate([PROMPTS[0]], sp, emit=lambda pi, toks: None)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain] and steps.decode_steps == 9


def test_model_eos_stops():
    cfg = qwen2_config()
    probe = BuiltinEngine.from_config(cfg, seed=0).generate([PROMPTS[0]], greedy(steps=6))[0].token_ids
    eng = BuiltinEngine.from_config(qwen2_config(eos_token_id=probe[2]), seed=0)
    r = eng.generate([PROMPTS[0]], greedy(steps=6))[0]
    assert r.finish_reason == "stop" and r.token_ids == probe[: probe.index(probe[2]) + 1]


def test_sampling_deterministic_per_seed(qwen):
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, n=3)
    a = qwen.generate(PROMPTS, sp)
    b = qwen.generate(PROMPTS, sp)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    c = qwen.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, seed=8, n=3))
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    assert a[0].token_ids != a[1].token_ids  # the n rows of one prompt are not copies


def test_sampling_logprob_is_temperature_scaled(qwen):
    sp = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=20, top_p=0.9, seed=1)
    r = qwen.generate([PROMPTS[0]], sp)[0]
    ids = PROMPTS[0] + r.token_ids
    with torch.no_grad():
        logits = qwen.model(torch.tensor([ids])).logits[0].float()
    pos = torch.arange(len(PROMPTS[0]) - 1, len(ids) - 1)
    want = torch.log_softmax(logits[pos] / 0.7, -1).gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-5)


def test_top_k_1_equals_greedy(qwen):
    g = qwen.generate(PROMPTS, greedy())
    k1 = qwen.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.8, top_k=1, seed=3))
    assert [r.token_ids for r in g] == [r.token_ids for r in k1]


def test_prefix_cache_hit_is_identical(qwen):
    first = qwen.generate([PROMPTS[0]], greedy(n=2))
    assert qwen.prefix_cache_entries() == 1 and not first[0].prefix_cache_hit
    second = qwen.generate([PROMPTS[0]], greedy(n=2))
    assert all(r.prefix_cache_hit for r in second)
    assert [(r.token_ids, r.logprobs) for r in first] == [(r.token_ids, r.logprobs) for r in second]
    # a prompt that merely extends a cached one is its own key
    assert not qwen.generate([PROMPTS[0] + [1]], greedy())[0].prefix_cache_hit


def test_weight_update_invalidates_prefix_cache(qwen):
    before = qwen.generate([PROMPTS[0]], greedy())[0]
    _, logits_before = qwen.score(PROMPTS[0], 1)
    assert qwen.prefix_cache_entries() == 1
    name = "model.layers.0.self_attn.v_proj.weight"
    w = qwen.model.state_dict()[name]
    qwen.load_weights([(name, w + 0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))])
    qwen.flush_cache()
    assert qwen.prefix_cache_entries() == 0
    after = qwen.generate([PROMPTS[0]], greedy())[0]
    assert not after.prefix_cache_hit
    _, logits_after = qwen.score(PROMPTS[0], 1)
    assert not torch.equal(logits_before, logits_after)
    assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)
    assert after.token_ids == reference_greedy(qwen.model, PROMPTS[0], 12)[0]


def test_load_weights_alone_drops_stale_prefixes(qwen):
    qwen.generate([PROMPTS[0]], greedy())
    name = "model.norm.weight"
    qwen.load_weights([(name, qwen.model.state_dict()[name] * 2)])
    assert qwen.prefix_cache_entries() == 0
    assert not qwen.generate([PROMPTS[0]], greedy())[0].prefix_cache_hit


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_load_weights_round_trip(kind):
    src = BuiltinEngine.from_config(CONFIGS[kind](), seed=1)
    dst = BuiltinEngine.from_config(CONFIGS[kind](), seed=2)
    ids = [9, 8, 7, 6, 5]
    assert not torch.equal(src.score(ids, 1)[1], dst.score(ids, 1)[1])
    ptrs = {n: p.data_ptr() for n, p in dst.model.named_parameters()}
    sd = src.model.state_dict()  # save_pretrained-like names; lm_head.weight present even when tied
    items = list(sd.items())
    for i in range(0, len(items), 3):  # bucket by bucket
        dst.load_weights(items[i : i + 3])
    assert {n: p.data_ptr() for n, p in dst.model.named_parameters()} == ptrs  # in place
    for n, t in dst.model.state_dict().items():
        assert torch.equal(t, sd[n]), n
    assert torch.equal(src.score(ids, 1)[1], dst.score(ids, 1)[1])


def test_param_metas_names_and_tied_embedding():
    untied = BuiltinEngine.from_config(CONFIGS["qwen2"](), seed=0)
    tied = BuiltinEngine.from_config(CONFIGS["qwen2_tied"](), seed=0)
    m = untied.param_metas()
    assert m["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert m["lm_head.weight"].shape == (256, 64) and m["lm_head.weight"].dtype == torch.float32
    assert set(m) == set(untied.model.state_dict())
    tm = tied.param_metas()
    assert "lm_head.weight" not in tm and "model.embed_tokens.weight" in tm
    assert set(tm) == set(tied.model.state_dict()) - {"lm_head.weight"}
    assert tied.num_parameters() == sum(x.numel() for x in tied.model.parameters())
    assert untied.num_parameters() - tied.num_parameters() == 256 * 64
    assert tied.num_ranks() == 1
    # the tied head accepts either name and lands in the one shared tensor
    w = torch.randn(256, 64)
    tied.load_weights([("lm_head.weight", w)])
    assert torch.equal(tied.model.get_input_embeddings().weight, w)
    assert torch.equal(tied.model.get_output_embeddings().weight, w)


def test_load_weights_casts_dtype_and_rejects_bad_batches(qwen):
    name = "model.norm.weight"
    before = {n: t.clone() for n, t in qwen.model.state_dict().items()}
    good = (name, torch.full((64,), 3.0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        qwen.load_weights([good, ("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"lm_head.weight.*\[256, 32\].*\[256, 64\]"):
        qwen.load_weights([good, ("lm_head.weight", torch.zeros(256, 32))])
    for n, t in qwen.model.state_dict().items():  # nothing of a rejected batch was copied
        assert torch.equal(t, before[n]), n
    qwen.load_weights([good])
    p = qwen.model.state_dict()[name]
    assert p.dtype == torch.float32 and torch.equal(p, torch.full((64,), 3.0))


def test_input_validation(qwen):
    sp = greedy()
    with pytest.raises(ValueError, match=r"prompts\[1\].*empty"):
        qwen.generate([[1], []], sp)
    with pytest.raises(ValueError, match=r"prompts\[0\].*256"):
        qwen.generate([[1, 256]], sp)
    with pytest.raises(ValueError, match=r"prompts\[0\].*-1"):
        qwen.generate([[-1]], sp)
    with pytest.raises(ValueError, match="max_new_tokens.*max_position_embeddings"):
        qwen.generate([[1] * 120], SamplingParams(max_new_tokens=9, temperature=0))
    with pytest.raises(ValueError, match="sampling.top_p"):
        qwen.generate([[1]], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="prompt_length"):
        qwen.score([1, 2, 3], 0)
    with pytest.raises(ValueError, match="token_ids.*empty"):
        qwen.score([], 0)
    assert qwen.prefix_cache_entries() == 0  # nothing ran


def test_from_config_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    a = BuiltinEngine.from_config(qwen2_config(), seed=5)
    assert torch.equal(torch.rand(3), expect)
    b = BuiltinEngine.from_config(qwen2_config(), seed=5)
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), n
    assert not any(p.requires_grad for p in a.model.parameters())
    assert not a.model.training


def test_from_pretrained_local_dir_bf16(tmp_path):
    src = BuiltinEngine.from_config(CONFIGS["qwen2_tied"](), seed=3)
    src.model.save_pretrained(tmp_path)
    eng = BuiltinEngine.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert eng.dtype == torch.bfloat16
    assert all(m.dtype == torch.bfloat16 for m in eng.param_metas().values())
    assert set(eng.param_metas()) == set(src.param_metas())
    emb = eng.model.get_input_embeddings().weight
    assert torch.equal(emb, src.model.get_input_embeddings().weight.to(torch.bfloat16))
    out = eng.generate([PROMPTS[0]], greedy(steps=4))[0]
    assert len(out.token_ids) == 4 and all(lp <= 0 for lp in out.logprobs)
