"""Token choice and reported log-probs, on hand-made logits."""

from __future__ import annotations

import torch

from rollout_svc.engine.base import SamplingParams
from rollout_svc.engine.sampling import _filter_top_k_top_p, choose


def test_greedy_is_argmax_with_raw_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tok, lp = choose(logits, SamplingParams(temperature=0), None)
    assert tok.tolist() == [1, 0]
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda f: torch.isfinite(f)[0].tolist()  # noqa: E731
    assert kept(_filter_top_k_top_p(logits, 2, 1.0)) == [True, True, False, False]
    assert kept(_filter_top_k_top_p(logits, 0, 0.5)) == [True, False, False, False]
    assert kept(_filter_top_k_top_p(logits, 0, 0.8)) == [True, True, False, False]
    assert kept(_filter_top_k_top_p(logits, 0, 0.81)) == [True, True, True, False]


def test_sampled_logprob_is_untruncated_and_temperature_scaled():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=0.5, top_k=5, top_p=0.9)
    tok, lp = choose(logits, sp, torch.Generator().manual_seed(1))
    assert torch.equal(lp, torch.log_softmax(logits / 0.5, -1).gather(-1, tok[:, None])[:, 0])
    top5 = logits.topk(5, -1).indices
    assert all(t in row for t, row in zip(tok.tolist(), top5.tolist()))


def test_a_vanishing_temperature_is_greedy_instead_of_nan():
    # found by the gRPC fuzzer: logits / 5e-324 overflow to inf, and multinomial raised on NaN
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    for t in (5e-324, 1e-300, 1e-7):
        tok, lp = choose(logits, SamplingParams(temperature=t), torch.Generator().manual_seed(0))
        assert tok.tolist() == [1, 0]
        assert torch.equal(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_non_finite_or_negative_temperature_is_rejected():
    import math

    import pytest

    for t in (math.nan, math.inf, -math.inf, -0.5):
        with pytest.raises(ValueError, match=r"sampling.temperature=.* must be a finite number >= 0"):
            SamplingParams(temperature=t).validate()
    SamplingParams(temperature=0.0).validate()
    SamplingParams(temperature=1e-300).validate()


def test_top_p_too_small_for_fp32_still_keeps_the_top_token():
    # also from the fuzzer: 1e-300 is 0.0 in fp32, and "mass before >= 0" dropped every token
    logits = torch.tensor([[0.0, 0.0, 0.0], [1.0, 3.0, 2.0]])
    f = _filter_top_k_top_p(logits, 0, 1e-300)
    assert torch.isfinite(f).sum(-1).tolist() == [1, 1] and torch.isfinite(f[1, 1])
    tok, lp = choose(logits, SamplingParams(temperature=1e300, top_p=1e-300), torch.Generator().manual_seed(0))
    assert tok.shape == (2,) and torch.isfinite(lp).all()
