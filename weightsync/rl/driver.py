"""One RL loop over the control plane: generate → reward → TrainStep → Sync → next step.

Colocated on one GPU (`release_memory`: SGLang with enable_memory_saver), each step also asks every rollout
to release its engine's GPU memory (ReleaseMemory) right before the train step (after the mismatch's
ComputeLogprobs); the sync maps it again (weights before its first bucket, the KV cache at commit) and the
rollouts refuse requests until it has committed.

Every arrow is a gRPC call to a running trainer-svc / rollout-svc; nothing here imports torch.
Each step also measures the train/inference mismatch: the rollouts' log-probs of the tokens they
sampled versus the trainer's `ComputeLogprobs` on the same tokens, both at the version the
rollouts served (i.e. right after the previous sync). With syncs on, that is the numerical gap
between two implementations of one function (≈1e-6 in fp32 on CPU); with syncs off it is the
gap between two different policies.

Sampling uses temperature 1 and no top-k/top-p: the rollout then reports log-probs of the same
distribution the trainer scores (ComputeLogprobs has no temperature field).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.rl.reward import RewardFn, score
from weightsync.rl.tasks import Task
from weightsync.v1 import rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    prompts_per_step: int = 8
    group_size: int = 8  # samples per prompt (GRPO group)
    max_new_tokens: int = 8
    algorithm: str = "grpo"
    aggregation: str = "token-mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    micro_batch_size: int = 0
    sync: bool = True  # False: the control experiment, rollouts never see new weights
    measure_mismatch: bool = True
    checkpoint_every: int = 0  # 0 = never; else SaveCheckpoint every N steps (trainer's checkpoint_dir)
    checkpoint_dir: str = ""
    seed: int = 0
    token: str = ""
    rpc_timeout_s: float = 300.0
    #: colocated: each step, once generation is done, the rollouts release their engine's GPU memory
    #: (ReleaseMemory) for the trainer; the sync maps it again (SGLang with enable_memory_saver)
    release_memory: bool = False
    release_timeout_s: float = 60.0


@dataclass
class StepRecord:
    step: int  # trainer step after this iteration
    reward_mean: float
    rollout_version: int  # version that generated this step's samples
    trainer_version: int  # trainer version after the train step
    synced_version: int  # version the rollouts serve after the sync (0 = no sync)
    sync_seconds: float
    sync_ok: bool
    mismatch_max: float  # max |rollout logprob - trainer logprob| on sampled tokens
    mismatch_mean: float
    loss: float
    entropy: float
    kl: float
    grad_norm: float
    clip_frac: float
    generate_seconds: float
    train_seconds: float
    metrics: dict = field(default_factory=dict)
    release_seconds: float = 0.0  # ReleaseMemory on every rollout (0 when not colocated)

    def as_dict(self) -> dict:
        return asdict(self)


def _generate(stubs, prompts: list[list[int]], cfg: LoopConfig, seed: int):
    """Split prompts over the rollouts; returns [(prompt_index, token_ids, logprobs)], versions."""
    shards = [list(range(i, len(prompts), len(stubs))) for i in range(len(stubs))]

    def one(k):
        idx = shards[k]
        if not idx:
            return [], None
        req = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=prompts[i]) for i in idx],
            return_logprobs=True,
            sampling=rollout_pb2.SamplingParams(
                max_new_tokens=cfg.max_new_tokens, temperature=1.0, n=cfg.group_size, seed=seed * 1000 + k
            ),
        )
        resp = stubs[k].Generate(req)
        return [(idx[s.prompt_index], list(s.token_ids), list(s.logprobs)) for s in resp.samples], resp.version

    # each call runs in the caller's context: under a span of the caller's (its step), the stub sends
    # that span's traceparent and the rollout's generation continues the caller's trace
    caller = contextvars.copy_context()
    with ThreadPoolExecutor(len(stubs)) as pool:
        parts = list(pool.map(lambda k: caller.copy().run(one, k), range(len(stubs))))
    samples = [s for part, _ in parts for s in part]
    versions = {v for _, v in parts if v is not None}
    return samples, versions


def _mismatch(trainer, samples: list[trainer_pb2.TrainSample]) -> tuple[float, float]:
    resp = trainer.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(samples=samples))
    worst, total, n = 0.0, 0.0, 0
    for s, row in zip(samples, resp.rows):
        for a, b in zip(s.rollout_logprobs, row.logprobs):
            d = abs(a - b)
            worst, total, n = max(worst, d), total + d, n + 1
    return worst, total / max(n, 1)


def _sync(trainer, what: str) -> trainer_pb2.SyncReport:
    rep = trainer.Sync(trainer_pb2.SyncRequest()).report
    if not rep.ok:
        errors = "; ".join(f"{r.rollout_id}: {r.error}" for r in rep.rollouts if not r.ok)
        raise RuntimeError(f"{what} to version {rep.version} failed: {errors}")
    return rep


def _samples(generated, prompts, reward_fn: RewardFn) -> list[trainer_pb2.TrainSample]:
    return [
        trainer_pb2.TrainSample(
            prompt_ids=prompts[i],
            response_ids=ids,
            rollout_logprobs=lps,
            reward=score(reward_fn, prompts[i], ids),
            group_id=i,
        )
        for i, ids, lps in generated
        if ids
    ]


def _release(stubs, cfg: LoopConfig) -> float:
    """Colocated: every rollout frees its engine's GPU memory for the trainer's step; returns the seconds taken."""
    t0 = time.perf_counter()
    for stub in stubs:
        stub.ReleaseMemory(rollout_pb2.ReleaseMemoryRequest(timeout_seconds=cfg.release_timeout_s))
    return time.perf_counter() - t0


def _step(
    trainer, stubs, task: Task, cfg: LoopConfig, reward_fn: RewardFn, loss_cfg, rng, around_train=None
) -> StepRecord:
    """One iteration: generate → reward → (mismatch) → (release) → train step → sync → (checkpoint).
    `around_train`: a context manager factory entered around the train step (bench/sglang_rl.py samples
    the GPU's memory there)."""
    prompts = task.prompts(rng, cfg.prompts_per_step)
    t0 = time.perf_counter()
    generated, versions = _generate(stubs, prompts, cfg, seed=rng.randrange(1 << 30))
    t_gen = time.perf_counter() - t0
    if len(versions) != 1:
        raise RuntimeError(f"rollouts served different versions {sorted(versions)} in one step")
    (rollout_version,) = versions
    samples = _samples(generated, prompts, reward_fn)
    mm = _mismatch(trainer, samples) if cfg.measure_mismatch else (float("nan"), float("nan"))
    # the rollouts are not needed again before the sync, which maps their memory again
    t_release = _release(stubs, cfg) if cfg.release_memory else 0.0
    t1 = time.perf_counter()
    with around_train() if around_train else contextlib.nullcontext():
        tr = trainer.TrainStep(
            trainer_pb2.TrainStepRequest(samples=samples, loss=loss_cfg, micro_batch_size=cfg.micro_batch_size)
        )
    t_train = time.perf_counter() - t1
    rep = _sync(trainer, "sync") if cfg.sync else None
    if cfg.checkpoint_every and tr.step % cfg.checkpoint_every == 0:
        trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=cfg.checkpoint_dir))
    m = dict(tr.metrics)
    return StepRecord(
        step=tr.step,
        reward_mean=sum(s.reward for s in samples) / max(len(samples), 1),
        rollout_version=rollout_version,
        trainer_version=tr.version,
        synced_version=rep.version if rep else 0,
        sync_seconds=rep.seconds if rep else 0.0,
        sync_ok=bool(rep and rep.ok),
        mismatch_max=mm[0],
        mismatch_mean=mm[1],
        loss=m.get("loss", 0.0),
        entropy=m.get("entropy", 0.0),
        kl=m.get("kl", 0.0),
        grad_norm=m.get("grad_norm", 0.0),
        clip_frac=m.get("clip_frac", 0.0),
        generate_seconds=t_gen,
        train_seconds=t_train,
        metrics=m,
        release_seconds=t_release,
    )


def run_loop(
    trainer_address: str,
    rollout_addresses: list[str],
    task: Task,
    steps: int,
    cfg: LoopConfig | None = None,
    reward_fn: RewardFn | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    around_train=None,
) -> list[StepRecord]:
    """Run `steps` RL iterations against running services; returns one record per step. `around_train`: see
    `_step`."""
    cfg = cfg or LoopConfig()
    reward_fn = reward_fn or task.reward
    trainer = trainer_stub(channel(trainer_address), cfg.token, cfg.rpc_timeout_s)
    stubs = [rollout_stub(channel(a), cfg.token, cfg.rpc_timeout_s) for a in rollout_addresses]
    if not stubs:
        raise ValueError("rollout_addresses: empty; the loop needs at least one rollout")
    rng = random.Random(cfg.seed)
    loss_cfg = trainer_pb2.LossConfig(
        algorithm=cfg.algorithm,
        aggregation=cfg.aggregation,
        clip_eps_low=cfg.clip_eps_low,
        clip_eps_high=cfg.clip_eps_high,
        kl_coef=cfg.kl_coef,
        entropy_coef=cfg.entropy_coef,
    )
    # Any training call makes the trainer build its training state and apply --resume; do it before
    # the first sync so a resumed trainer publishes its checkpoint, not its fresh init. (A no-op once
    # trainer-svc calls init_training() at startup.)
    trainer.ComputeLogprobs(
        trainer_pb2.ComputeLogprobsRequest(samples=[trainer_pb2.TrainSample(prompt_ids=[0], response_ids=[0])])
    )
    if cfg.sync:  # step 1 must sample from the trainer's current weights, whatever the rollouts held
        _sync(trainer, "initial sync")
    records = []
    for _ in range(steps):
        records.append(_step(trainer, stubs, task, cfg, reward_fn, loss_cfg, rng, around_train))
        if on_step:
            on_step(records[-1])
    return records
