"""Losses against hand-computed small cases."""

import math

import pytest
import torch

from trainer_svc.train.logprobs import token_entropy
from trainer_svc.train.losses import aggregate, group_advantages, kl_k3, ppo_clip_loss


def test_group_advantages_normalise_within_groups_and_zero_std_groups_are_zero():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0])
    g = torch.tensor([0, 0, 1, 1, 2])
    a = group_advantages(r, g, eps=0.0)
    # group 0: mean .5, unbiased std sqrt(.5) -> ±.5/.7071
    s = math.sqrt(0.5)
    assert a.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0, 0.0])


def test_group_advantages_eps_shrinks():
    a = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([3, 3]), eps=0.1)
    s = math.sqrt(0.5)
    assert a.tolist() == pytest.approx([0.5 / (s + 0.1), -0.5 / (s + 0.1)])


def test_aggregate_token_mean_vs_seq_mean():
    v = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(16 / 4)
    assert float(aggregate(v, m, "seq-mean")) == pytest.approx((2.0 + 10.0) / 2)
    # micro-batches with the batch's denominators sum to the batch value
    parts = [aggregate(v[i : i + 1], m[i : i + 1], "token-mean", num_tokens=4) for i in range(2)]
    assert float(sum(parts)) == pytest.approx(4.0)
    parts = [aggregate(v[i : i + 1], m[i : i + 1], "seq-mean", num_seqs=2) for i in range(2)]
    assert float(sum(parts)) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(v, m, "sum")


def _one(ratio, adv, **kw):
    logp = torch.tensor([[math.log(ratio)]])
    loss, st = ppo_clip_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kw)
    return float(loss), float(st.clip_frac), float(st.dual_clip_frac)


def test_ppo_clip_hand_cases():
    # positive advantage: ratio above 1+eps_high is clipped
    assert _one(1.5, 2.0, clip_low=0.2, clip_high=0.3) == pytest.approx((-2.0 * 1.3, 1.0, 0.0))
    # positive advantage, ratio below 1-eps: unclipped branch is larger (pessimistic max)
    assert _one(0.5, 2.0, clip_low=0.2)[0] == pytest.approx(-1.0)
    # negative advantage, ratio below 1-eps_low: clipped at 0.8
    assert _one(0.5, -1.0, clip_low=0.2) == pytest.approx((0.8, 1.0, 0.0))
    # negative advantage, big ratio: unclipped -A*r = 10 ...
    assert _one(10.0, -1.0, clip_low=0.2)[0] == pytest.approx(10.0)
    # ... bounded by the dual clip c * -A = 3
    assert _one(10.0, -1.0, clip_low=0.2, dual_clip_c=3.0) == pytest.approx((3.0, 0.0, 1.0))
    # inside the trust region: plain -A * r
    assert _one(1.1, 1.0)[0] == pytest.approx(-1.1)
    with pytest.raises(ValueError, match="dual_clip_c"):
        _one(1.0, 1.0, dual_clip_c=0.5)


def test_ppo_gradient_is_zero_where_clipped():
    logp = torch.tensor([[math.log(1.5), math.log(1.05)]], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] == pytest.approx(-1.05 / 2)


def test_ppo_masked_tokens_do_not_count():
    logp = torch.tensor([[0.0, 5.0]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    assert float(loss) == pytest.approx(-1.0)


def test_kl_k3_hand_values():
    logp = torch.tensor([0.0, math.log(0.5), -1.0])
    ref = torch.tensor([0.0, 0.0, -1.5])
    d = ref - logp
    want = (d.exp() - d - 1).tolist()
    assert kl_k3(logp, ref).tolist() == pytest.approx(want)
    assert float(kl_k3(logp, ref)[0]) == 0.0 and float(kl_k3(logp, ref)[1]) == pytest.approx(2 - math.log(2) - 1)
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_entropy_uniform_and_peaked():
    assert float(token_entropy(torch.zeros(8))) == pytest.approx(math.log(8), rel=1e-6)
    assert float(token_entropy(torch.tensor([100.0, 0.0, 0.0]))) == pytest.approx(0.0, abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert float(token_entropy(p.log())) == pytest.approx(1.5 * math.log(2), rel=1e-6)
