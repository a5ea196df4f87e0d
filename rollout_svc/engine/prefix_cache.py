"""Prefix KV cache: the KV state (and last logits) after prefilling an exact prompt, LRU-bounded.

RL rollouts sample many completions of one prompt and revisit prompts across turns; a hit skips
the prefill. Entries are snapshots taken from the same prefill a miss performs, so a hit is
bit-identical to a miss. Entries depend on the weights: the sync transaction flushes the cache on
every update, and a hit after an update would be a correctness bug.

The key is the whole prompt, not a shared prefix: matching the longest cached prefix would need
a partial prefill on top of a cropped cache, whose numerics differ from a full prefill, and the
"hit == miss, bit for bit" guarantee is worth more here than the extra hits.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    cache: object  # transformers Cache after the prompt (batch 1)
    last_logits: torch.Tensor
    nbytes: int = 0


def cache_nbytes(cache: object) -> int:
    """Bytes held by a transformers Cache's tensors (layers with keys/values, plus any states)."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int | None = None):
        if max_entries < 0:
            raise ValueError(f"max_prefix_cache_entries={max_entries} must be >= 0")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_prefix_cache_bytes={max_bytes} must be >= 0 (None = no byte limit)")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # Bumped by flush(): a prefill that began before a flush must not store its (stale) result.
        self._epoch = 0
        self.hits = 0
        self.misses = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, prompt: list[int]) -> PrefixEntry | None:
        """A private copy of the entry: the decode loop extends and repeats its cache in place."""
        key = tuple(prompt)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return PrefixEntry(copy.deepcopy(entry.cache), entry.last_logits.clone(), entry.nbytes)

    def put(self, prompt: list[int], cache: object, last_logits: torch.Tensor, *, epoch: int) -> bool:
        """Store a snapshot taken at `epoch`; refused if a flush happened since or it cannot fit."""
        if self.max_entries == 0:
            return False
        nbytes = cache_nbytes(cache) + last_logits.numel() * last_logits.element_size()
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return False
        entry = PrefixEntry(copy.deepcopy(cache), last_logits.clone(), nbytes)
        key = tuple(prompt)
        with self._lock:
            if epoch != self._epoch:
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += nbytes
            while len(self._entries) > self.max_entries or (
                self.max_bytes is not None and self._bytes > self.max_bytes
            ):
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
        return True

    def flush(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._epoch += 1

    def __len__(self) -> int:
        return len(self._entries)
