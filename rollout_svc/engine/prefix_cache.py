"""Prefix KV cache: the KV state (and last logits) after prefilling an exact prompt, LRU-bounded.

RL rollouts sample many completions of one prompt and revisit prompts across turns; a hit skips
the prefill. Entries are snapshots taken from the same prefill a miss performs, so a hit is
bit-identical to a miss. Entries depend on the weights: the sync transaction flushes the cache on
every update, and a hit after an update would be a correctness bug.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    cache: object            # transformers Cache after the prompt (batch 1)
    last_logits: torch.Tensor


class PrefixCache:
    def __init__(self, max_entries: int):
        if max_entries < 0:
            raise ValueError(f"max_prefix_cache_entries={max_entries} must be >= 0")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, prompt: list[int]) -> PrefixEntry | None:
        key = tuple(prompt)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return PrefixEntry(copy.deepcopy(entry.cache), entry.last_logits.clone())

    def put(self, prompt: list[int], cache: object, last_logits: torch.Tensor) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            self._entries[tuple(prompt)] = PrefixEntry(copy.deepcopy(cache), last_logits.clone())
            self._entries.move_to_end(tuple(prompt))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def flush(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
