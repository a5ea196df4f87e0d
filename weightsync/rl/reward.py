"""Pluggable reward functions: `module:function` taking (prompt_ids, response_ids) -> float."""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[list[int], list[int]], float]


def load_reward(spec: str) -> RewardFn:
    """Import `package.module:function`; errors say what was wrong with the spec."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"reward={spec!r} must be 'module:function', e.g. 'my_rewards:exact_match'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"reward={spec!r}: cannot import {mod_name}: {exc}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward={spec!r}: {mod_name} has no callable {fn_name}")
    return fn


def score(fn: RewardFn, prompt_ids: list[int], response_ids: list[int]) -> float:
    r = fn(list(prompt_ids), list(response_ids))
    try:
        return float(r)
    except (TypeError, ValueError):
        raise ValueError(f"reward function returned {r!r}; it must return a float") from None
