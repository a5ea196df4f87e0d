"""The RL driver's pure parts: the toy task, the pluggable reward loader, the table and the plot."""

import random

import pytest

from weightsync.rl.driver import StepRecord
from weightsync.rl.report import HEADER, plot, row
from weightsync.rl.reward import load_reward, score
from weightsync.rl.tasks import TargetTokensTask, make_task


def test_target_tokens_reward_and_chance():
    t = TargetTokensTask(vocab_size=256, modulus=8)
    assert t.chance_reward == 32 / 256
    assert t.reward([1], [0, 8, 3, 5]) == 0.5 and t.reward([1], []) == 0.0
    ps = t.prompts(random.Random(0), 5)
    assert len(ps) == 5 and all(len(p) == 4 and all(0 <= x < 256 for x in p) for p in ps)
    # a uniform sampler scores about chance
    rng = random.Random(1)
    r = sum(t.reward([], [rng.randrange(256) for _ in range(8)]) for _ in range(2000)) / 2000
    assert abs(r - 0.125) < 0.02
    with pytest.raises(ValueError, match="task="):
        make_task("nope", 256)


def test_reward_loader():
    fn = load_reward("weightsync.rl.tasks:TargetTokensTask")  # any callable resolves
    assert callable(fn)
    assert score(lambda p, r: 1, [1], [2]) == 1.0
    for bad, msg in [
        ("no_colon", "module:function"),
        ("nosuchmod_xyz:f", "cannot import"),
        ("weightsync.rl.tasks:missing", "no callable"),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_reward(bad)
    with pytest.raises(ValueError, match="must return a float"):
        score(lambda p, r: "x", [1], [2])


def test_table_and_plot(tmp_path):
    recs = [
        StepRecord(
            step=k,
            reward_mean=0.1 * k,
            rollout_version=k,
            trainer_version=k + 1,
            synced_version=k + 1,
            sync_seconds=0.02,
            sync_ok=True,
            mismatch_max=1e-6,
            mismatch_mean=5e-7,
            loss=0.0,
            entropy=5.0,
            kl=0.0,
            grad_norm=0.5,
            clip_frac=0.0,
            generate_seconds=0.1,
            train_seconds=0.05,
        )
        for k in range(1, 6)
    ]
    assert len(row(recs[0]).split()) == len(HEADER.split())
    png = plot(recs, tmp_path / "p.png", "t")
    assert png.read_bytes()[:4] == b"\x89PNG"
