"""One decode step for every request ready at the same time: the built-in engine's batching.

Each request runs `BuiltinEngine.generate` on its own thread (the service pins it to the served
version; no turns). All model work goes through one worker thread per engine: prefills (and
`score`) as jobs, between decode steps, and the decode steps. A request's decode state is a Member
(one prompt's n rows); members decode in groups, each group one KV cache over its members' rows:

- members that come together form one group: their caches are left-padded to one length and
  stacked; the attention mask hides the padding and explicit position ids keep each row's own
  positions, so a row attends to exactly its own tokens;
- the group that has run the fewest steps goes next, so a request that comes while others decode
  runs its first steps alone (as when requests took turns: a small request is not held to a large
  one's pace) and merges with the older group once it has run as many steps;
- a step waits for the group's members that are sampling their next token (at most MAX_GATHER_S
  after they got their logits); a member away longer (a stream reader with no room) gets a masked
  hole in its rows (a pad token nothing attends to), so nobody waits for a slow consumer;
- a member that leaves has its rows dropped; columns no row attends to any more are cut off.

Sampling stays on the request's thread with its own RNG and parameters, so what a request gets
does not depend on what else ran, up to the float rounding of a batched matmul (greedy tokens equal
and log-probs within 1e-4 on the test models: tests/unit/rollout_svc/engine/test_batcher.py).
Weight loads wait for every pinned request to end (engine_gate.py), so no group outlives weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

#: A step waits at most this long for a member that is here but has not handed in its tokens yet
#: (its thread not scheduled on a loaded host); then it runs without it and the member takes the next.
MAX_GATHER_S = 0.05
#: Bound on one wait for the worker (a job or a decode step); a longer one is a fault, not load.
WAIT_S = 600.0


def cache_is_batchable(cache) -> bool:
    """Left padding is sound for caches that keep every position (not a sliding window's ring)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def _left_pad(t: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    if k == 0:
        return t
    shape = list(t.shape)
    shape[dim] = k
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class Member:
    """One prompt's n rows decoding in the group; its methods run on the request's thread."""

    def __init__(self, batcher: "DecodeBatcher", cache, n: int, position: int):
        self.batcher, self.cache, self.n, self.position = batcher, cache, n, position
        self.tokens: torch.Tensor | None = None  # handed in, waiting for a step
        self.logits: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.left = False
        # when it last got logits (or joined): a step waits for it a little after that, not longer
        self.handed = time.monotonic()
        self.group: _Group | None = None  # set by the worker at the member's first step

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decode `tokens` [n] (one per row); returns the next logits [n, V] (fp32)."""
        cond = self.batcher.cond
        deadline = time.monotonic() + WAIT_S
        with cond:
            if self.error is not None:
                raise self.error
            self.tokens, self.logits = tokens, None
            cond.notify_all()
            while self.logits is None and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.left = True
                    raise TimeoutError(f"a decode step got no result within {WAIT_S:.0f} s (the engine's worker hung)")
                cond.wait(left)
            if self.error is not None:
                raise self.error
            out, self.logits = self.logits, None
            return out

    def close(self) -> None:
        with self.batcher.cond:
            self.left = True
            self.batcher.cond.notify_all()


class _Group:
    """Members decoding together: one KV cache over all their rows; touched by the worker thread only."""

    def __init__(self, m: Member):
        cache, m.cache = m.cache, None
        self.cache = cache
        length = cache.get_seq_length()
        device = cache.layers[0].keys.device
        self.mask = torch.ones(m.n, length, dtype=torch.long, device=device)  # [B, L]: 1 = a real token of that row
        self.pos = torch.full((m.n,), m.position, dtype=torch.long, device=device)  # [B]: each row's next position
        self.members: list[Member] = [m]  # in row order, each its n rows
        m.group = self
        # no padding and no holes: the forward needs no mask or positions (cheaper, and exactly the
        # computation of one request alone when it is alone)
        self.dense = True
        self.steps = 0  # forwards run: the group with the fewest goes first

    def rows(self) -> dict[int, slice]:
        out, start = {}, 0
        for m in self.members:
            out[id(m)] = slice(start, start + m.n)
            start += m.n
        return out

    def absorb(self, other: "_Group") -> None:
        """Take `other`'s members: both caches left-padded to one length and stacked."""
        have, length = self.mask.shape[1], other.mask.shape[1]
        to = max(have, length)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, to - have, -2), _left_pad(theirs.keys, to - length, -2)])
            mine.values = torch.cat([_left_pad(mine.values, to - have, -2), _left_pad(theirs.values, to - length, -2)])
        self.mask = torch.cat([_left_pad(self.mask, to - have, -1), _left_pad(other.mask, to - length, -1)])
        self.pos = torch.cat([self.pos, other.pos])
        self.members += other.members
        for m in other.members:
            m.group = self
        self.dense = self.dense and other.dense and have == length
        self.steps = max(self.steps, other.steps)

    def drop(self, gone: set[int]) -> None:
        if not any(id(m) in gone for m in self.members):
            return
        rows = self.rows()
        keep = [m for m in self.members if id(m) not in gone]
        if not keep:
            self.members = []
            return
        idx = torch.cat([torch.arange(rows[id(m)].start, rows[id(m)].stop) for m in keep]).to(self.mask.device)
        self.mask, self.pos, self.members = self.mask[idx], self.pos[idx], keep
        # columns that no row attends to any more (the padding of a longer member that left)
        first = int(self.mask.any(0).nonzero()[0])
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        self.mask = self.mask[:, first:]
        self.dense = bool(self.mask.all())

    def forward(self, model, ready: list[Member]) -> dict[int, torch.Tensor]:
        rows = self.rows()
        device = self.mask.device
        going = {id(m) for m in ready}
        # one concatenation and one copy a step, not two indexed writes per member
        ids = torch.cat(
            [
                m.tokens.to(device) if id(m) in going else torch.zeros(m.n, dtype=torch.long, device=device)
                for m in self.members
            ]
        )
        here = torch.tensor([int(id(m) in going) for m in self.members for _ in range(m.n)], device=device)
        self.mask = torch.cat([self.mask, here[:, None]], dim=1)
        self.dense = self.dense and len(going) == len(self.members)
        kw = {} if self.dense else {"attention_mask": self.mask, "position_ids": self.pos[:, None]}
        out = model(ids[:, None], past_key_values=self.cache, use_cache=True, **kw)
        self.cache = out.past_key_values
        self.pos = self.pos + here
        logits = out.logits[:, -1].float()
        return {id(m): logits[rows[id(m)]] for m in ready}


class DecodeBatcher:
    """The worker that runs every model call of one engine; started on demand, gone when idle."""

    def __init__(self, model: Callable[[], object]):
        #: the engine's model, asked at each step (tests swap in a counting wrapper)
        self.model = model
        self.cond = threading.Condition(threading.Lock())
        self._jobs: deque[list] = deque()  # [fn, result, error, done]
        self._members: list[Member] = []
        self._worker: threading.Thread | None = None
        self.steps = 0  # decode forwards run (tests and the bench read it)
        self.rows_decoded = 0
        self.widest = 0  # the most requests one decode step has run

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="builtin-engine-worker", daemon=True)
            self._worker.start()

    def call(self, fn: Callable[[], object]):
        """Run `fn()` on the worker, between decode steps; returns its result or raises its error."""
        job = [fn, None, None, False]
        deadline = time.monotonic() + WAIT_S
        with self.cond:
            self._jobs.append(job)
            self._ensure_worker()
            self.cond.notify_all()
            while not job[3]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the engine's worker did not run a job within {WAIT_S:.0f} s")
                self.cond.wait(left)
        if job[2] is not None:
            raise job[2]
        return job[1]

    def join(self, cache, n: int, position: int) -> Member:
        """A member for `cache` (n rows, `position` tokens each); it joins the group at its first step."""
        m = Member(self, cache, n, position)
        with self.cond:
            self._members.append(m)
            self._ensure_worker()
        return m

    # ---- worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        groups: list[_Group] = []
        gone: list[Member] = []  # members that left, their rows dropped before the next step
        with torch.no_grad():
            while True:
                with self.cond:
                    job, chosen, ready, newcomers = None, None, [], []
                    while True:
                        gone += [m for m in self._members if m.left]
                        self._members = [m for m in self._members if not m.left]
                        if self._jobs:
                            job = self._jobs.popleft()
                            break
                        if not self._members:
                            self._worker = None  # its groups go with it: nothing is in flight
                            return
                        newcomers = [m for m in self._members if m.group is None and m.tokens is not None]
                        if newcomers or gone:
                            break  # place them (below, outside the lock), then choose a group
                        chosen, ready, wait = _next_step(groups, time.monotonic())
                        if ready:
                            break
                        self.cond.wait(wait)
                if job is not None:
                    self._run_job(job)
                elif chosen is None:
                    self._regroup(groups, gone, newcomers)
                    gone = []
                else:
                    self._step(groups, chosen, ready)

    @staticmethod
    def _regroup(groups: list["_Group"], gone: list[Member], newcomers: list[Member]) -> None:
        ids = {id(m) for m in gone}
        for g in groups:
            g.drop(ids)
        groups[:] = [g for g in groups if g.members] + [_Group(m) for m in newcomers]
        _merge_level(groups)

    def _run_job(self, job: list) -> None:
        try:
            job[1] = job[0]()
        except BaseException as exc:  # handed to the caller, who raises it
            job[2] = exc
        with self.cond:
            job[3] = True
            self.cond.notify_all()

    def _step(self, groups: list["_Group"], group: "_Group", ready: list[Member]) -> None:
        try:
            logits = group.forward(self.model(), ready)
        except BaseException as exc:
            # the group's cache may be half updated: every member in it fails, the other groups go on
            log.exception("built-in engine: a batched decode step failed; its %d requests fail", len(group.members))
            with self.cond:
                for m in group.members:
                    m.error, m.tokens = exc, None
                self.cond.notify_all()
            groups.remove(group)
            return
        group.steps += 1
        _merge_level(groups)
        with self.cond:
            self.steps += 1
            self.rows_decoded += sum(m.n for m in ready)
            self.widest = max(self.widest, len(ready))
            now = time.monotonic()
            for m in ready:
                m.logits, m.tokens, m.handed = logits[id(m)], None, now
            self.cond.notify_all()


def _next_step(groups: list[_Group], now: float) -> tuple[_Group | None, list[Member], float]:
    """(group, its members ready, 0) for the next decode step, or (None, [], how long to wait).

    The group that has run the fewest steps goes first (least attained service: a new request runs
    its first steps alone, not at the pace of a large one, then joins it), counting a member that got
    its logits less than MAX_GATHER_S ago as coming: it is sampling its next token. Within the group
    the step waits for those; a member away longer (a stream reader with no room) sits steps out."""
    coming = lambda m: m.tokens is None and now - m.handed < MAX_GATHER_S  # noqa: E731
    live = [g for g in groups if any(m.tokens is not None or coming(m) for m in g.members)]
    if not live:
        return None, [], WAIT_S
    group = min(live, key=lambda g: g.steps)
    late = [m.handed for m in group.members if coming(m)]
    if late:
        return None, [], max(min(late) + MAX_GATHER_S - now, 1e-4)
    return group, [m for m in group.members if m.tokens is not None], 0.0


def _merge_level(groups: list[_Group]) -> None:
    """Groups that have run as many steps decode together from now on: requests that came together,
    or a younger group that has caught up with an older one."""
    level: dict[int, _Group] = {}
    for g in list(groups):
        twin = level.setdefault(g.steps, g)
        if twin is not g:
            twin.absorb(g)
            groups.remove(g)
