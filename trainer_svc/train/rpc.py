"""gRPC training calls of the Trainer service: TrainStep, ComputeLogprobs, SaveCheckpoint.

A mixin for `TrainerServicer` (which provides `self.actor` and `self.actor_lock`). Requests are
validated here, at the boundary, so a bad sample is an INVALID_ARGUMENT naming the field, never a
shape error deep inside the model. Every call holds the actor lock: a step never overlaps a sync
(which would publish half-updated weights) or a weight load.

Training state (optimizer, step, reference model) is created on the first training call; with
`resume` set, that first call also restores the latest checkpoint under `checkpoint_dir`. Each call
runs on every trainer rank through `trainer_svc.train.collective`.
"""

from __future__ import annotations

import logging

import grpc

from weightsync.v1 import trainer_pb2

log = logging.getLogger(__name__)
LOCK_WAIT_S = 60.0


def validate_samples(samples, vocab_size: int, max_positions: int, need_logprobs: bool = False) -> None:
    if not samples:
        raise ValueError("samples: empty; send at least one TrainSample")
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"samples[{i}].prompt_ids: empty (a response needs at least one prompt token)")
        if not s.response_ids:
            raise ValueError(f"samples[{i}].response_ids: empty")
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(s, name)
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"samples[{i}].{name}: token id {bad} outside the vocabulary [0, {vocab_size})")
        n = len(s.prompt_ids) + len(s.response_ids)
        if n > max_positions:
            raise ValueError(
                f"samples[{i}]: prompt_ids + response_ids = {n} tokens > max_position_embeddings {max_positions}"
            )
        if len(s.rollout_logprobs) not in (0, len(s.response_ids)):
            raise ValueError(
                f"samples[{i}].rollout_logprobs: {len(s.rollout_logprobs)} values for "
                f"{len(s.response_ids)} response_ids"
            )
    given = sum(1 for s in samples if len(s.rollout_logprobs))
    if given not in (0, len(samples)):
        raise ValueError(
            f"samples[].rollout_logprobs: given for {given} of {len(samples)} samples; send them for "
            "all samples or none (none = the trainer scores the behaviour policy itself)"
        )


CHECKPOINT_FORMATS = ("native", "torch_dist")


def check_checkpoint_format(fmt: str, actor) -> None:
    if fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f"format: {fmt!r} is not one of {', '.join(CHECKPOINT_FORMATS)} (empty = native)")
    if fmt == "torch_dist" and not hasattr(actor, "save_megatron"):
        raise ValueError(
            "format: torch_dist is a Megatron distributed checkpoint; this trainer's backend has no "
            "Megatron model (use backend=megatron, or format native)"
        )


class TrainingServicerMixin:
    #: the TrainerConfig training reads (`optim`, `checkpoint`); None = resolved from WS_TRAINER_* env
    train_cfg = None
    #: TrainMetrics on the orchestrator's registry, made on the first step
    train_metrics = None

    # ---- startup ------------------------------------------------------------------------
    def init_training(self, cfg=None) -> bool:
        """Build the training state now (on every rank) and apply `resume`; returns whether a
        checkpoint was loaded. Call once at startup, before serving, so a resumed trainer reports
        (and publishes) the checkpoint's version from the start; otherwise the first training call
        does it. `cfg`: the TrainerConfig."""
        if cfg is not None:
            self.train_cfg = cfg
        with self.actor_lock:
            before = self.actor.version
            self._training()
            return self.actor.version != before

    # ---- helpers ------------------------------------------------------------------------
    def _train_metrics(self):
        orch = getattr(self, "orch", None)
        if self.train_metrics is None and orch is not None:
            from weightsync.obs.metrics import TrainMetrics

            self.train_metrics = TrainMetrics(orch.metrics.registry)
        return self.train_metrics

    def _training(self):
        """The actor's TrainState; the first call builds it on every rank and applies --resume."""
        import dataclasses

        from trainer_svc.train import collective

        if self.actor.train_state is not None:
            return self.actor.train_state
        cfg = self._train_config()
        if collective.run(
            self.actor, "train_init", optim=dataclasses.asdict(cfg.optim), checkpoint=dataclasses.asdict(cfg.checkpoint)
        ):
            self._after_weights_changed()
        return self.actor.train_state

    def _train_config(self):
        """The TrainerConfig handed over by the app; without one (a bare servicer), the one the
        WS_TRAINER_* env and defaults give, through the same config resolver as the CLI."""
        if self.train_cfg is None:
            import argparse

            from trainer_svc.config import ENV_PREFIX, TrainerConfig
            from weightsync.config import resolve

            self.train_cfg = resolve(TrainerConfig, argparse.Namespace(), ENV_PREFIX)
        return self.train_cfg

    def _after_weights_changed(self) -> None:
        orch = getattr(self, "orch", None)
        if orch is not None:
            orch.metrics.version.set(self.actor.version)

    def _limits(self) -> tuple[int, int]:
        cfg = self.actor.hf_config()
        return int(cfg.vocab_size), int(getattr(cfg, "max_position_embeddings", 1 << 30))

    def _run(self, context, what: str, fn):
        """Run fn under the actor lock; ValueError → INVALID_ARGUMENT, OSError → FAILED_PRECONDITION,
        anything else → INTERNAL (logged with its traceback)."""
        if not self.actor_lock.acquire(timeout=LOCK_WAIT_S):
            context.abort(grpc.StatusCode.ABORTED, f"{what}: a sync or weight load is running; retry when it finishes")
        error = None
        try:
            return fn()
        except ValueError as exc:
            error = (grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {exc}")
        except OSError as exc:
            error = (grpc.StatusCode.FAILED_PRECONDITION, f"{what}: {exc}")
        except Exception as exc:
            log.exception("%s failed", what)
            error = (grpc.StatusCode.INTERNAL, f"{what}: {type(exc).__name__}: {exc}")
        finally:
            self.actor_lock.release()
        context.abort(*error)

    # ---- RPCs ---------------------------------------------------------------------------
    def TrainStep(self, request, context):
        from trainer_svc.train.step import LossSpec

        try:
            validate_samples(request.samples, *self._limits())
            LossSpec.from_proto(request.loss)
            if request.loss.algorithm == "ppo" and len(request.loss.advantages) not in (0, len(request.samples)):
                raise ValueError(
                    f"loss.advantages: {len(request.loss.advantages)} values for {len(request.samples)} samples"
                )
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        def step():
            from trainer_svc.train import collective

            self._training()
            metrics = collective.run(self.actor, "train_step", request)
            self._after_weights_changed()
            tm = self._train_metrics()
            if tm is not None:
                tm.observe(self.actor.step, metrics)
            return metrics

        metrics = self._run(context, "train_step", step)
        return trainer_pb2.TrainStepResponse(version=self.actor.version, step=self.actor.step, metrics=metrics)

    def ComputeLogprobs(self, request, context):
        try:
            validate_samples(request.samples, *self._limits())
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        def score():
            from trainer_svc.train import collective

            self._training()
            return collective.run(self.actor, "compute_logprobs", request)

        rows = self._run(context, "compute_logprobs", score)
        resp = trainer_pb2.ComputeLogprobsResponse(version=self.actor.version)
        for r in rows:
            resp.rows.add(logprobs=r)
        return resp

    def SaveCheckpoint(self, request, context):
        # A path from the network stays inside the data roots (trainer_svc/paths.py); "" = checkpoint_dir.
        requested = self._resolve(context, "dir", request.dir) if request.dir else ""

        def save():
            from trainer_svc.train import collective

            self._training()
            directory = requested or self._train_config().checkpoint.checkpoint_dir
            if not directory:
                raise ValueError("dir: empty and the trainer has no checkpoint_dir configured")
            fmt = request.format or "native"
            check_checkpoint_format(fmt, self.actor)
            return collective.run(self.actor, "save_checkpoint", dir=directory, format=fmt)

        path = self._run(context, "save_checkpoint", save)
        return trainer_pb2.SaveCheckpointResponse(dir=path, step=self.actor.step, version=self.actor.version)
