"""train_step / compute_logprobs / checkpoints on the transformers backend."""

import pytest
import torch

from tests.support.train_requests import make_request
from trainer_svc.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_svc.train.step import compute_logprobs, train_state, train_step


def _with_behaviour_logprobs(actor, req):
    rows = compute_logprobs(actor, list(req.samples))
    for s, row in zip(req.samples, rows):
        s.rollout_logprobs[:] = row
    return req


def test_logprobs_match_a_direct_forward(hf_actor_factory):
    a = hf_actor_factory()
    req = make_request()
    rows = compute_logprobs(a, list(req.samples), micro_batch_size=3)
    for s, row in zip(req.samples, rows):
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(a.model(ids).logits[0].float(), -1)
        p = len(s.prompt_ids)
        want = [float(lp[p - 1 + j, t]) for j, t in enumerate(s.response_ids)]
        assert row == pytest.approx(want, abs=1e-5)


def test_loss_decreases_on_a_fixed_batch_and_versions_bump(hf_actor_factory):
    a = hf_actor_factory()
    req = _with_behaviour_logprobs(a, make_request())
    v0 = a.version
    losses = [train_step(a, req)["loss"] for _ in range(8)]
    assert a.version == v0 + 8 and a.step == 8
    assert losses[-1] < losses[0] - 0.05, losses


def test_micro_batching_does_not_change_the_step(hf_actor_factory):
    for agg in ("token-mean", "seq-mean"):
        out = []
        for mbs in (0, 3):
            a = hf_actor_factory(grad_clip=0.0)
            req = _with_behaviour_logprobs(a, make_request(aggregation=agg))
            req.micro_batch_size = mbs
            m = train_step(a, req)
            out.append(
                (m["loss"], m["grad_norm"], [p.grad.clone() for p in a.model.parameters() if p.grad is not None])
            )
        assert out[0][0] == pytest.approx(out[1][0], abs=1e-6)
        assert out[0][1] == pytest.approx(out[1][1], rel=1e-5)
        # gradients, not Adam-updated weights: Adam turns fp-noise-sized grads into lr-sized steps
        assert len(out[0][2]) == len(out[1][2])
        assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(out[0][2], out[1][2]))


def test_kl_and_entropy_terms(hf_actor_factory):
    a = hf_actor_factory()
    req = _with_behaviour_logprobs(a, make_request(kl_coef=0.5, entropy_coef=0.01))
    m0 = train_step(a, req)
    assert m0["kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the pre-step policy
    assert m0["entropy"] > 5.0  # near-uniform over 256 tokens (ln 256 = 5.55)
    m1 = train_step(a, req)
    assert m1["kl"] > 0.0
    ref = compute_logprobs(a, list(req.samples), reference=True)
    assert ref[0] == pytest.approx(list(req.samples[0].rollout_logprobs), abs=1e-5)


def test_lr_warmup_is_linear_then_constant(hf_actor_factory):
    a = hf_actor_factory(lr=1e-3, lr_warmup_steps=4)
    req = make_request()
    lrs = [train_step(a, req)["lr"] for _ in range(6)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_checkpoint_resume_gives_identical_next_steps(hf_actor_factory, tmp_path):
    req = make_request(kl_coef=0.1)
    a = hf_actor_factory()
    _with_behaviour_logprobs(a, req)
    for _ in range(3):
        train_step(a, req)
    save_checkpoint(a, str(tmp_path))
    want = [train_step(a, req)["loss"] for _ in range(2)]

    b = hf_actor_factory(seed=99)  # different init: everything must come from the checkpoint
    load_checkpoint(b, latest_checkpoint(str(tmp_path)))
    assert (b.step, b.version) == (3, a.version - 2)
    got = [train_step(b, req)["loss"] for _ in range(2)]
    assert got == want
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert train_state(b).optimizer.state_dict()["state"][0]["step"] == 5
