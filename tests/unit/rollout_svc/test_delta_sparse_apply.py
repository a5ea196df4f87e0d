"""Delta syncs write only the changed words into the engine, and stay bit-exact or fail.

Real TrainerApp (hf backend, sync_encoding=delta) and RolloutApps (one staged, one inplace) on
loopback gRPC, TCP bus, tiny-qwen2 (the engine's parameters are the buckets' bytes, same dtype).
Counted: the words written into the engine per sync (rollout_svc/sync/sparse_write.py) and the full
checked copies of buckets (verified_copy.copy_into / copy_bucket). Checked: after several delta
syncs the engine holds exactly the trainer's export, though only the changed words were written;
a damaged delta or a damaged base copy still fails the commit by its checksum with the sparse path
on; after an abort, and whenever the engine was not written byte for byte, the full checked copy
runs again, then the sparse path resumes.
"""

from __future__ import annotations

import pytest
import torch

from rollout_svc.sync import apply_inplace, apply_staged
from tests.support.fleet_sync import bump_and_sync_exactly, change_weights
from tests.support.local_apps import local_fleet
from weightsync.v1 import rollout_pb2, trainer_pb2


@pytest.fixture(scope="module")
def fleet():
    with local_fleet(
        {"staged": {"apply_mode": "staged"}, "inplace": {"apply_mode": "inplace"}}, sync_encoding="delta"
    ) as fleet:
        fleet.trainer.orch.bucket_bytes = 64 << 10  # several buckets (tiny-qwen2 is 0.4 MB)
        bump_and_sync_exactly(*fleet)  # every test starts from a committed base
        yield fleet


class _Counts:
    """Words written sparsely and full bucket copies, per apply mode, since the last reset."""

    def __init__(self, monkeypatch):
        self.words = {"staged": 0, "inplace": 0}
        self.full = {"staged": 0, "inplace": 0}
        for mode, mod in (("staged", apply_staged), ("inplace", apply_inplace)):
            real_write = mod.write

            def write(words, params, word, _mode=mode, _real=real_write):
                self.words[_mode] += sum(w.local.numel() for w in words)
                return _real(words, params, word)

            monkeypatch.setattr(mod, "write", write)
        real_copy_into, real_copy_bucket = apply_inplace.copy_into, apply_staged.copy_bucket

        def copy_into(*a, **k):
            self.full["inplace"] += 1
            return real_copy_into(*a, **k)

        def copy_bucket(*a, **k):
            self.full["staged"] += 1
            return real_copy_bucket(*a, **k)

        monkeypatch.setattr(apply_inplace, "copy_into", copy_into)
        monkeypatch.setattr(apply_staged, "copy_bucket", copy_bucket)

    def reset(self):
        self.words = dict.fromkeys(self.words, 0)
        self.full = dict.fromkeys(self.full, 0)


@pytest.fixture
def counts(monkeypatch):
    return _Counts(monkeypatch)


def _sync(stub) -> trainer_pb2.SyncReport:
    return stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report


def _exact(trainer, app) -> bool:
    return app.tx.version == trainer.actor.version and all(
        torch.equal(app.engine._target(name), t) for name, t in trainer.actor.export_tensors()
    )


def _model_words(trainer) -> int:
    return sum(t.numel() * t.element_size() // 2 for _, t in trainer.actor.export_tensors())


def _sparse_sync(trainer, rollouts, stub, counts, seed: int) -> None:
    """A 2 % change synced as deltas, written into both engines as the changed words alone; exact."""
    assert all(app.tx.delta_base.engine_matches for app in rollouts.values())
    counts.reset()
    change_weights(trainer, 0.02, seed=seed)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    assert {r.encoding for r in report.rollouts} == {"delta"}
    words = _model_words(trainer)
    for mode, app in rollouts.items():
        assert counts.full[mode] == 0, (mode, counts.full)  # no bucket copied in full
        # about 2 % of the words (and the gap encoding's fillers), never the bucket
        assert 0.01 * words < counts.words[mode] < 0.04 * words, (mode, counts.words[mode], words)
        assert _exact(trainer, app), mode
        assert app.tx.delta_base.engine_matches, mode


def test_delta_syncs_write_only_the_changed_words_and_stay_exact(fleet, counts):
    trainer, rollouts, stub = fleet
    for seed in range(3):
        _sparse_sync(trainer, rollouts, stub, counts, seed)


def test_a_damaged_delta_fails_the_commit_with_the_sparse_path_on(fleet, counts, monkeypatch):
    trainer, rollouts, stub = fleet
    from weightsync.publisher import delta_sync

    _sparse_sync(trainer, rollouts, stub, counts, seed=10)
    real = delta_sync.encode
    encoded = []

    def flipped(*args):
        payload = real(*args)
        encoded.append(payload is not None)
        if payload is not None and sum(encoded) > 1:  # the first delta bucket intact, then damaged
            payload[-1] ^= 0x01  # the last new word: decodes fine, applies a wrong value
        return payload

    monkeypatch.setattr(delta_sync, "encode", flipped)
    versions = {rid: app.tx.version for rid, app in rollouts.items()}
    counts.reset()
    change_weights(trainer, 0.02, seed=11)
    report = _sync(stub)
    assert not report.ok
    for rid, r in {r.rollout_id: r for r in report.rollouts}.items():
        app = rollouts[rid]
        assert not r.ok and r.encoding == "delta" and "checksum" in app.tx.last_error, (rid, r.error)
        assert "DATA_LOSS" in app.tx.aborted_here[1], app.tx.aborted_here
        assert app.tx.version == versions[rid]
        assert not app.tx.delta_base.engine_matches
    # staged touched nothing; inplace wrote the first bucket's changed words before the damaged one: STALE
    assert counts.words["staged"] == 0 and counts.words["inplace"] > 0
    assert rollouts["staged"].tx.state == rollout_pb2.SERVING
    assert rollouts["inplace"].tx.state == rollout_pb2.STALE
    monkeypatch.setattr(delta_sync, "encode", real)
    # after the abort: a full sync (every bucket copied and checked in full), then deltas sparse again
    counts.reset()
    change_weights(trainer, 0.02, seed=12)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"full"}, [r.error for r in report.rollouts]
    assert counts.words == {"staged": 0, "inplace": 0} and min(counts.full.values()) > 0
    assert all(_exact(trainer, app) for app in rollouts.values())
    _sparse_sync(trainer, rollouts, stub, counts, seed=13)


def test_a_damaged_base_copy_fails_the_commit_with_the_sparse_path_on(fleet, counts):
    trainer, rollouts, stub = fleet
    _sparse_sync(trainer, rollouts, stub, counts, seed=20)
    versions = {rid: app.tx.version for rid, app in rollouts.items()}
    for app in rollouts.values():
        app.tx.delta_base._bufs[0][:4096] ^= (
            0x10  # many words: the delta changes some of them (the sums see what it overwrites)
        )
    counts.reset()
    change_weights(trainer, 0.02, seed=21)
    report = _sync(stub)
    for rid, r in {r.rollout_id: r for r in report.rollouts}.items():
        app = rollouts[rid]
        assert not r.ok and r.encoding == "delta" and "checksum" in app.tx.last_error, (rid, r.error)
        assert app.tx.version == versions[rid]
    counts.reset()
    change_weights(trainer, 0.02, seed=22)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"full"}
    assert all(_exact(trainer, app) for app in rollouts.values())


def test_damage_no_delta_touches_never_reaches_the_engine(fleet, counts):
    """A base copy damaged behind its sums' back, in a word no delta changes: the sparse path never
    copies that word, so the engine stays exact; a full copy out of the copy would be checked."""
    trainer, rollouts, stub = fleet
    _sparse_sync(trainer, rollouts, stub, counts, seed=30)
    name = next(iter(trainer.actor.export_tensors()))[0]
    for app in rollouts.values():
        copy = app.tx.delta_base._bufs[0]
        # the first bucket starts with that tensor
        assert torch.equal(copy[:4], app.engine._target(name).reshape(-1).view(torch.uint8)[:4])
        copy[1] ^= 0x10  # its first value
    with torch.no_grad():  # the change keeps that value and the next (the sums' 32-bit word, whatever the dtype)
        first = trainer.actor.model.get_parameter(name)
        keep = first.reshape(-1)[:2].clone()
        change_weights(trainer, 0.02, seed=31)
        first.reshape(-1)[:2] = keep
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"delta"}
    assert all(_exact(trainer, app) for app in rollouts.values())
    for app in rollouts.values():
        app.tx.delta_base._bufs[0][1] ^= 0x10  # repaired (the value did not change), for the next test


def test_an_engine_not_written_byte_for_byte_gets_the_full_checked_copy(fleet, counts, monkeypatch):
    """A sync whose buckets went through the engine's own loader (no writable parameters) leaves
    the engine not known to equal the base copy: the next delta sync copies and checks every
    bucket in full (still a delta on the wire), and the one after is sparse again."""
    trainer, rollouts, stub = fleet
    _sparse_sync(trainer, rollouts, stub, counts, seed=40)
    for app in rollouts.values():
        monkeypatch.setattr(app.engine, "writable_params", lambda metas: None)
    counts.reset()
    change_weights(trainer, 0.02, seed=41)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"delta"}, [r.error for r in report.rollouts]
    assert counts.words == {"staged": 0, "inplace": 0}
    assert all(_exact(trainer, app) and not app.tx.delta_base.engine_matches for app in rollouts.values())
    for app in rollouts.values():
        monkeypatch.delattr(app.engine, "writable_params")
    counts.reset()
    change_weights(trainer, 0.02, seed=42)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"delta"}
    assert counts.words == {"staged": 0, "inplace": 0}
    assert counts.full["staged"] > 0 and counts.full["inplace"] > 0  # the fallback: full checked copies
    assert all(_exact(trainer, app) and app.tx.delta_base.engine_matches for app in rollouts.values())
    _sparse_sync(trainer, rollouts, stub, counts, seed=43)
