"""One RL optimisation step and log-prob scoring, for either actor backend.

    samples → batch → advantages (GRPO) → [reference log-probs] → micro-batches through the
    backend's forward/backward (loss: PPO-clip + k3 KL − entropy) → clip grads → AdamW step → version++

The backend (transformers or megatron-core) only runs micro-batches and owns the parameters; the
loss, advantages and bookkeeping are written once here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from trainer_svc.config import OptimConfig
from trainer_svc.train.backend import TrainBackend
from trainer_svc.train.batch import Batch, make_batch
from trainer_svc.train.logprobs import token_entropy, token_logprobs
from trainer_svc.train.losses import AGGREGATIONS, aggregate, group_advantages, kl_k3, ppo_clip_loss

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What training adds to an actor; kept in the actor's `train_state` field."""

    optim: OptimConfig
    backend: TrainBackend
    optimizer: torch.optim.Optimizer
    step: int = 0
    reference: list | None = None  # frozen copy of the model chunks (only once kl/reference is used)
    extra: dict = field(default_factory=dict)


def train_state(actor, optim: OptimConfig | None = None) -> TrainState:
    """The actor's training state, created on first use (optimizer built lazily: serving-only trainers
    pay nothing) with the trainer config's `optim` section (defaults when none is given)."""
    st = actor.train_state
    if st is None:
        optim = optim or OptimConfig()
        backend = actor.train_backend()
        st = actor.train_state = TrainState(optim, backend, backend.make_optimizer(optim))
        actor.step = 0
    return st


def ensure_reference(st: TrainState) -> list:
    if st.reference is None:
        log.info("snapshotting a frozen reference model at step %d", st.step)
        st.reference = st.backend.frozen_copy()
    return st.reference


@dataclass
class LossSpec:
    algorithm: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float = 0.0
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    @classmethod
    def from_proto(cls, lc) -> "LossSpec":
        low = lc.clip_eps_low or 0.2
        spec = cls(
            algorithm=lc.algorithm or "grpo",
            clip_low=low,
            clip_high=lc.clip_eps_high or low,
            dual_clip_c=lc.dual_clip_c,
            aggregation=lc.aggregation or "token-mean",
            kl_coef=lc.kl_coef,
            entropy_coef=lc.entropy_coef,
        )
        if spec.algorithm not in ("grpo", "ppo"):
            raise ValueError(f"loss.algorithm={spec.algorithm!r} must be grpo or ppo")
        if spec.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation={spec.aggregation!r} must be one of {list(AGGREGATIONS)}")
        if spec.dual_clip_c and spec.dual_clip_c <= 1:
            raise ValueError(f"loss.dual_clip_c={spec.dual_clip_c} must be > 1 (or 0 = off)")
        if not (0 < spec.clip_low < 1) or spec.clip_high <= 0:
            raise ValueError(f"loss.clip_eps_low={spec.clip_low} must be in (0, 1) and clip_eps_high > 0")
        if spec.kl_coef < 0 or spec.entropy_coef < 0:
            raise ValueError("loss.kl_coef and loss.entropy_coef must be >= 0")
        return spec


def _advantages(samples, lc, spec: LossSpec) -> torch.Tensor:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if spec.algorithm == "grpo":
        return group_advantages(rewards, torch.tensor([s.group_id for s in samples]))
    if len(lc.advantages):
        if len(lc.advantages) != len(samples):
            raise ValueError(f"loss.advantages has {len(lc.advantages)} values for {len(samples)} samples")
        return torch.tensor(list(lc.advantages), dtype=torch.float32)
    return rewards.float()  # ppo without a critic: the raw reward is the advantage


def _score(st: TrainState, batch: Batch, mbs: int, modules=None) -> torch.Tensor:
    """[B, L] log-probs of the targets (0 off the mask), no grad; valid on every rank."""
    be = st.backend

    def fn(logits, mb):
        lp = token_logprobs(logits, mb.targets, tp_group=be.tp_group, vocab_size=be.vocab_size)
        return None, lp * mb.mask

    outs = be.run(batch.micro_batches(mbs), fn, lambda mb: tuple(mb.mask.shape), train=False, modules=modules)
    full = torch.zeros_like(batch.mask)
    row = 0
    for out in outs:
        n = min(out.shape[0], batch.size - row)
        full[row : row + n, : out.shape[1]] = out[:n, : full.shape[1]]
        row += n
    return full


def compute_logprobs(actor, samples, reference: bool = False, micro_batch_size: int = 0) -> list[list[float]]:
    """Per-sample log-probs of response_ids given prompt_ids, under the actor or the frozen reference."""
    st = train_state(actor)
    modules = ensure_reference(st) if reference else None
    batch = make_batch(samples)
    return batch.rows(_score(st, batch, micro_batch_size, modules))


#: per-micro-batch values the loss function reports; each is a share of the batch value (summed),
#: except the *_max ones (max over micro-batches)
MB_METRICS = (
    "loss",
    "pg_loss",
    "entropy",
    "kl",
    "clip_frac",
    "dual_clip_frac",
    "ratio_mean",
    "approx_kl",
    "logprob_diff_mean",
    "logprob_diff_max",
)


def _micro_batch_loss(spec: LossSpec, kw: dict, agg: dict, n_tok: float):
    """loss_fn(logits, micro batch) -> (loss, the MB_METRICS row): PPO-clip policy loss, optional
    entropy bonus and k3 KL to the reference, each aggregated over the whole step's tokens/sequences."""

    def loss_fn(logits, mb):
        logp = token_logprobs(logits, mb.targets, **kw)
        pg, cs = ppo_clip_loss(
            logp,
            mb.old_logp,
            mb.advantages,
            mb.mask,
            clip_low=spec.clip_low,
            clip_high=spec.clip_high,
            dual_clip_c=spec.dual_clip_c,
            aggregation=spec.aggregation,
            **agg,
        )
        loss = pg
        with torch.set_grad_enabled(spec.entropy_coef > 0 and torch.is_grad_enabled()):
            ent = aggregate(token_entropy(logits, **kw), mb.mask, spec.aggregation, **agg)
        if spec.entropy_coef > 0:
            loss = loss - spec.entropy_coef * ent
        kl = torch.zeros(())
        if spec.kl_coef > 0:
            kl = aggregate(kl_k3(logp, mb.ref_logp), mb.mask, spec.aggregation, **agg)
            loss = loss + spec.kl_coef * kl
        w = float(mb.mask.sum()) / max(n_tok, 1.0)
        diff = (logp.detach() - mb.old_logp).abs() * mb.mask
        out = torch.tensor(
            [
                float(loss.detach()),
                float(pg.detach()),
                float(ent.detach()),
                float(kl.detach()),
                w * float(cs.clip_frac),
                w * float(cs.dual_clip_frac),
                w * float(cs.ratio_mean),
                w * float(cs.approx_kl),
                float(diff.sum()) / max(n_tok, 1.0),
                float(diff.max()),
            ]
        )
        return loss, out

    return loss_fn


def train_step(actor, request) -> dict[str, float]:
    """Run one optimisation step on a TrainStepRequest; returns metrics (identical on every rank)."""
    t0 = time.perf_counter()
    st = train_state(actor)
    be = st.backend
    spec = LossSpec.from_proto(request.loss)
    samples = list(request.samples)
    batch = make_batch(samples, _advantages(samples, request.loss, spec))
    mbs = request.micro_batch_size
    if spec.kl_coef > 0:
        batch.ref_logp = _score(st, batch, mbs, ensure_reference(st))
    if not batch.has_old_logp:
        batch.old_logp = _score(st, batch, mbs)  # on-policy: ratio is exactly 1 at the first step
    n_tok, n_seq = float(batch.mask.sum()), float(batch.size)
    kw = dict(tp_group=be.tp_group, vocab_size=be.vocab_size)
    agg = dict(num_tokens=n_tok, num_seqs=n_seq)

    loss_fn = _micro_batch_loss(spec, kw, agg, n_tok)

    lr = st.optim.lr_at(st.step)
    for g in st.optimizer.param_groups:
        g["lr"] = lr
    st.optimizer.zero_grad(set_to_none=True)
    outs = be.run(batch.micro_batches(mbs), loss_fn, lambda mb: (len(MB_METRICS),), train=True)
    grad_norm = be.step(st.optimizer, st.optim.grad_clip)
    st.step += 1
    actor.step = st.step
    actor.version += 1
    stacked = torch.stack(outs)
    metrics = {
        k: float(stacked[:, i].max() if k.endswith("_max") else stacked[:, i].sum()) for i, k in enumerate(MB_METRICS)
    }
    rewards = torch.tensor([s.reward for s in samples])
    metrics.update(
        grad_norm=grad_norm,
        lr=lr,
        reward_mean=float(rewards.mean()),
        num_samples=n_seq,
        num_tokens=n_tok,
        response_len_mean=n_tok / max(n_seq, 1.0),
        advantage_abs_mean=float(batch.advantages.abs().mean()),
        step_seconds=time.perf_counter() - t0,
        rollout_logprobs_given=float(batch.has_old_logp),
    )
    return metrics
