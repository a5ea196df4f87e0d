"""A Publisher over a torch.distributed group (weightsync/publisher/collective.py): the ranks agree on
who owns which tensor before anything is sent, every rank raises the same error naming the tensor
when they do not, and a valid sync returns the same report on every rank. Two gloo ranks, no rollout
(the streaming itself runs in tests/e2e/test_megatron_publisher_example.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.megatron_models import SUPPORT, torchrun

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module", params=[2, 3], ids=["whole-job", "subgroup"])
def results(request) -> dict[str, dict[int, dict]]:
    """Group ranks' results by case; with 3 processes the group is global ranks 1 and 2 (rank 0
    stays out: the group's own rank 0 serves)."""
    # this checkout's packages, not whichever copy the environment has installed
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = torchrun(SUPPORT / "_group_publisher.py", request.param, [], timeout=300, backend_env={"PYTHONPATH": path})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got: dict[str, dict[int, dict]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            got.setdefault(r["case"], {})[r["rank"]] = r
    return got


def _same_error_everywhere(results, case: str) -> str:
    by_rank = results[case]
    assert set(by_rank) == {0, 1}, by_rank
    assert not by_rank[0]["ok"] and not by_rank[1]["ok"], by_rank
    assert by_rank[0]["error"] == by_rank[1]["error"], by_rank
    assert by_rank[0]["type"] == by_rank[1]["type"] == "ValueError", by_rank
    return by_rank[0]["error"]


def test_a_tensor_given_by_two_ranks_is_refused_on_every_rank_naming_it(results):
    assert _same_error_everywhere(results, "twice").startswith("norm.weight: given by rank 0 and rank 1")


def test_a_tensor_no_rank_gives_is_refused_naming_it(results):
    assert _same_error_everywhere(results, "missing").startswith("layer.1.weight: given by no rank (1 missing)")


def test_one_ranks_bad_share_fails_every_rank_naming_the_rank_and_tensor(results):
    err = _same_error_everywhere(results, "shape")
    assert err.startswith("rank 1: layer.1.weight: shape (2, 4), declared (4, 4)"), err
    assert "lm_head.weight: not a declared tensor" in _same_error_everywhere(results, "unknown")


def test_a_rank_whose_own_tensors_raise_keeps_the_ranks_in_step(results):
    # the user's iterable broke on rank 1 only: every rank fails this sync, the next one works
    err = _same_error_everywhere(results, "raises")
    assert err == 'rank 1: its tensors failed: KeyError: "the user\'s export broke"', err


def test_a_refused_sync_publishes_nothing_and_a_valid_one_reports_on_every_rank(results):
    for case, version in (("valid", 1), ("valid-again", 2)):
        by_rank = results[case]
        assert set(by_rank) == {0, 1}, by_rank
        for r in by_rank.values():
            # the four refused syncs did not bump the version; no rollout: ok=False, nothing raised
            assert r["ok"] and r["version"] == r["pub_version"] == version, r
            assert r["report_ok"] is False and r["rollouts"] == 0, r


def test_only_rank_0_serves_and_options_a_group_cannot_honour_are_refused(results):
    assert results["address"][0]["ok"] and results["address"][0]["address"].startswith("127.0.0.1:")
    assert not results["address"][1]["ok"] and "rank 1 of the group only sends" in results["address"][1]["error"]
    for rank in (0, 1):
        assert "snapshot=True with a group" in results["snapshot"][rank]["error"]
        assert "transport='ipc' streams from one process" in results["ipc"][rank]["error"]


def test_a_sync_started_outside_publisher_sync_is_refused_instead_of_waiting_for_the_ranks():
    """wsctl sync / the Sync RPC reach rank 0's orchestrator while the other ranks are not in
    sync(): the stream fails at once (its rollouts are aborted) rather than waiting for them."""
    import threading

    import torch

    from weightsync.publisher.collective import GroupSource
    from weightsync.publisher.declared import metas_from_dict

    class Channel:
        rank, flags = 0, None
        sent: list = []

        def send(self, op, **args):
            self.sent.append(op)

        def gather(self, result):
            return [result]

    channel = Channel()
    source = GroupSource(metas_from_dict({"w": ((2,), torch.float32)}), "", torch.device("cpu"), channel)
    with pytest.raises(RuntimeError, match="streams only inside Publisher.sync"):
        source.run_senders({})
    source._sync_thread = threading.get_ident() + 1  # a collective sync runs, in another thread
    with pytest.raises(RuntimeError, match="streams only inside Publisher.sync"):
        source.run_senders({})
    assert channel.sent == []  # no rank was told to stream
