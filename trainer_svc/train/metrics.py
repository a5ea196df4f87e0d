"""Prometheus metrics of the training calls (registered on the trainer's sync-metrics registry)."""
from __future__ import annotations

_SECONDS_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300)


class TrainMetrics:
    def __init__(self, registry):
        from prometheus_client import Counter, Gauge, Histogram

        r = registry
        self.steps = Counter("weightsync_train_steps_total", "Optimizer steps taken by TrainStep", registry=r)
        self.step = Gauge("weightsync_train_step", "Trainer step counter (restored by --resume)", registry=r)
        self.step_seconds = Histogram("weightsync_train_step_duration_seconds", "Wall time of one TrainStep",
                                      buckets=_SECONDS_BUCKETS, registry=r)
        self.loss = Gauge("weightsync_train_loss", "Loss of the last TrainStep", registry=r)
        self.reward = Gauge("weightsync_train_reward_mean", "Mean reward of the last TrainStep's samples", registry=r)
        self.grad_norm = Gauge("weightsync_train_grad_norm", "Global grad norm of the last step (before clipping)",
                               registry=r)
        # the train/inference gap: |rollout log-prob - trainer log-prob| on the sampled tokens, taken
        # before the update; it measures numerics when the samples came from the current version
        self.mismatch_max = Gauge("weightsync_train_inference_logprob_diff_max",
                                  "Max |rollout - trainer| log-prob on the last TrainStep's sampled tokens", registry=r)
        self.mismatch_mean = Gauge("weightsync_train_inference_logprob_diff_mean",
                                   "Mean |rollout - trainer| log-prob on the last TrainStep's sampled tokens",
                                   registry=r)

    def observe(self, step: int, m: dict[str, float]) -> None:
        self.steps.inc()
        self.step.set(step)
        self.step_seconds.observe(m.get("step_seconds", 0.0))
        self.loss.set(m.get("loss", 0.0))
        self.reward.set(m.get("reward_mean", 0.0))
        self.grad_norm.set(m.get("grad_norm", 0.0))
        if m.get("rollout_logprobs_given"):
            self.mismatch_max.set(m.get("logprob_diff_max", 0.0))
            self.mismatch_mean.set(m.get("logprob_diff_mean", 0.0))
