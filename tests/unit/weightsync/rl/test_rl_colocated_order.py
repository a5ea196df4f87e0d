"""The RL driver's step, colocated (LoopConfig.release_memory): every rollout releases its engine's GPU memory
once generation is done, right before the trainer's step, and the sync that follows maps it again; over
recording stand-ins for the trainer's and the rollouts' gRPC stubs."""

import random

import pytest

from weightsync.rl.driver import LoopConfig, _step
from weightsync.rl.tasks import TargetTokensTask
from weightsync.v1 import rollout_pb2, trainer_pb2


class _Stub:
    """Records (who, RPC) in a shared list and answers each RPC with a minimal response."""

    def __init__(self, who: str, log: list, answers: dict):
        self.who, self.log, self.answers = who, log, answers

    def __getattr__(self, rpc):
        def call(req, **kw):
            self.log.append((self.who, rpc))
            return self.answers[rpc](req)

        return call


def _generate(req):
    out = rollout_pb2.GenerateResponse(version=3)
    for i, _ in enumerate(req.prompts):
        for _ in range(req.sampling.n):
            out.samples.add(prompt_index=i, token_ids=[8, 1], logprobs=[-0.5, -0.6])
    return out


def _rollout(who, log):
    answers = {"Generate": _generate, "ReleaseMemory": lambda r: rollout_pb2.ReleaseMemoryResponse(version=3)}
    return _Stub(who, log, answers)


def _trainer(log, train):
    def sync(req):
        log.append(("trainer", "sync commits: memory mapped again"))
        return trainer_pb2.SyncResponse(report=trainer_pb2.SyncReport(ok=True, version=4))

    answers = {
        "ComputeLogprobs": lambda r: trainer_pb2.ComputeLogprobsResponse(
            rows=[trainer_pb2.LogprobRow(logprobs=list(s.rollout_logprobs)) for s in r.samples]
        ),
        "TrainStep": lambda r: train.append(len(r.samples)) or trainer_pb2.TrainStepResponse(step=1, version=4),
        "Sync": sync,
    }
    return _Stub("trainer", log, answers)


@pytest.mark.parametrize("release", [True, False])
def test_rollouts_release_their_memory_after_generating_and_before_the_train_step(release):
    log, train = [], []
    stubs = [_rollout("r0", log), _rollout("r1", log)]
    cfg = LoopConfig(prompts_per_step=2, group_size=2, release_memory=release)
    task = TargetTokensTask(vocab_size=16)
    entered = []

    def around_train():
        import contextlib

        @contextlib.contextmanager
        def cm():
            entered.append([e for e in log])
            yield

        return cm()

    rec = _step(
        _trainer(log, train), stubs, task, cfg, task.reward, trainer_pb2.LossConfig(), random.Random(0), around_train
    )
    calls = [c for c in log if c[1] != "Sync"]
    gen = {("r0", "Generate"), ("r1", "Generate")}
    assert set(calls[:2]) == gen
    released = [("r0", "ReleaseMemory"), ("r1", "ReleaseMemory")] if release else []
    assert calls[2:] == [
        ("trainer", "ComputeLogprobs"),
        *released,
        ("trainer", "TrainStep"),
        ("trainer", "sync commits: memory mapped again"),
    ]
    assert (rec.release_seconds > 0) == release
    # the train step ran with every rollout's memory already released, inside around_train
    assert entered and (("r1", "ReleaseMemory") in entered[0]) == release
    assert train == [4] and rec.synced_version == 4 and rec.sync_ok


def test_the_cli_starts_sglang_rollouts_colocated_and_releasing():
    from weightsync.rl.__main__ import _engine_args, _parser

    ns = _parser().parse_args(["--engine", "sglang", "--sglang-arg", "mem_fraction_static=0.3"])
    args = _engine_args(ns)
    assert args[:8] == ["--device", "cuda:0", "--engine", "sglang", "--apply-mode", "inplace", "--dtype", "bfloat16"]
    assert args[8:] == ["--sglang-arg", "enable_memory_saver=true", "--sglang-arg", "mem_fraction_static=0.3"]
    assert _engine_args(_parser().parse_args([])) == []  # the built-in engine: the rollout's own defaults
