"""Small verifiable tasks: prompts plus a rule that scores a response exactly.

`TargetTokensTask` — reward = fraction of response tokens that fall in a fixed target subset of
the vocabulary (ids divisible by `modulus`). A randomly initialised model samples almost
uniformly, so the chance reward is |subset| / V = 1/modulus (0.125 by default), and every group
of samples has some reward spread from the first step on (GRPO gets a signal immediately, unlike
exact-match tasks where a random model almost never scores). Learning it only needs the output
distribution to concentrate on the subset — a tiny model does that in a few dozen steps on a
CPU, which makes it a fast, unambiguous check that the weights the trainer learns actually reach
the rollouts: without syncs the rollouts keep sampling at chance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


class Task(Protocol):
    name: str
    chance_reward: float

    def prompts(self, rng: random.Random, n: int) -> list[list[int]]: ...

    def reward(self, prompt_ids: list[int], response_ids: list[int]) -> float: ...


@dataclass
class TargetTokensTask:
    vocab_size: int = 256
    modulus: int = 8
    prompt_len: int = 4
    name: str = "target-tokens"

    def __post_init__(self):
        if not 2 <= self.modulus <= self.vocab_size:
            raise ValueError(f"modulus={self.modulus} must be in [2, vocab_size={self.vocab_size}]")

    @property
    def chance_reward(self) -> float:
        return len(range(0, self.vocab_size, self.modulus)) / self.vocab_size

    def prompts(self, rng: random.Random, n: int) -> list[list[int]]:
        return [[rng.randrange(self.vocab_size) for _ in range(self.prompt_len)] for _ in range(n)]

    def reward(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        if not response_ids:
            return 0.0
        return sum(1 for t in response_ids if t % self.modulus == 0) / len(response_ids)


TASKS = {"target-tokens": TargetTokensTask}


def make_task(name: str, vocab_size: int, **kw) -> Task:
    if name not in TASKS:
        raise ValueError(f"task={name!r} is not one of {sorted(TASKS)}")
    return TASKS[name](vocab_size=vocab_size, **kw)
