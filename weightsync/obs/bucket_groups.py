"""A sender's stream cut into a bounded number of bucket groups, for its trace (one span per group).

A sender records a group while it streams (`sent` after each bucket, in order) and reports the groups
with its result; rank 0 turns them into `stream.group` spans under the sender's `stream.sender` span
(weightsync/obs/tracing.py). A group is a run of consecutive buckets of the sender, at most
`MAX_GROUPS` per sender per sync, so a 1000-bucket sync makes 16 spans a sender, not 1000. Only made
when tracing is on: off, no recorder exists and the stream calls nothing.
"""

from __future__ import annotations

import time

MAX_GROUPS = 16


class BucketGroups:
    """The groups of one sender's buckets (`indices`: the manifest indices it streams, in order)."""

    def __init__(self, indices: list[int], max_groups: int = MAX_GROUPS):
        if max_groups < 1:
            raise ValueError(f"max_groups={max_groups} must be >= 1")
        self.indices = list(indices)
        self.per_group = max(1, -(-len(self.indices) // max_groups))  # ceil: at most max_groups groups
        self.t0 = time.perf_counter()
        #: [first bucket index, last bucket index, buckets, bytes, start s, end s] (seconds from t0)
        self.groups: list[list] = []
        self._sent = 0
        self._bytes = 0
        self._start = 0.0

    def sent(self, nbytes: int) -> None:
        """One more bucket went out (the stream's `on_sent`)."""
        self._sent += 1
        self._bytes += nbytes
        in_group = self._sent - len(self.groups) * self.per_group
        if in_group == self.per_group or self._sent == len(self.indices):
            self._close(in_group)

    def close(self) -> list[list]:
        """The groups, with the buckets sent since the last full one as a last group (a stream that
        failed halfway shows how far it came)."""
        open_count = self._sent - sum(g[2] for g in self.groups)
        if open_count:
            self._close(open_count)
        return self.groups

    def _close(self, count: int) -> None:
        now = time.perf_counter() - self.t0
        first = self._sent - count
        self.groups.append([self.indices[first], self.indices[self._sent - 1], count, self._bytes, self._start, now])
        self._bytes, self._start = 0, now
