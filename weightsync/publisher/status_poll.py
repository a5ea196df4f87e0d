"""The trainer's GetStatus asks every registered rollout for its status at once, not in turn.

Each ask carries its own timeout (the registry's, at most 5 s), so asked in turn three silent
rollouts made `wsctl status` take 15 s, and a fleet of tens of them minutes. Asked by a bounded pool,
the answer takes about one timeout per `MAX_CONCURRENT` silent rollouts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

#: status calls in flight at once (each is a small unary RPC; the bound keeps a large fleet's
#: GetStatus from opening hundreds of threads)
MAX_CONCURRENT = 32


def poll_all(registry, entries: list) -> None:
    """registry.poll(e) for every entry, concurrently; returns when every one answered or timed out."""
    if len(entries) <= 1:
        for e in entries:
            registry.poll(e)
        return
    with ThreadPoolExecutor(min(MAX_CONCURRENT, len(entries)), thread_name_prefix="status-poll") as pool:
        for f in [pool.submit(registry.poll, e) for e in entries]:
            f.result()  # poll records an RPC failure on the entry; anything else is a bug to raise
