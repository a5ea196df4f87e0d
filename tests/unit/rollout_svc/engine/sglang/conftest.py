"""Fixtures shared by the SGLang adapter's tests that drive SglangEngine without SGLang installed."""

from __future__ import annotations

import sys
import types

import pytest


@pytest.fixture
def io_struct(monkeypatch):
    """SGLang's pause/continue request types (the adapter imports them in begin_apply / end_apply)."""
    mod = types.ModuleType("sglang.srt.managers.io_struct")
    mod.PauseGenerationReqInput = lambda mode: ("pause", mode)
    mod.ContinueGenerationReqInput = lambda: ("continue",)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", mod)


@pytest.fixture
def ipc(monkeypatch):
    """CUDA IPC stood in for on the CPU: SGLang's worker shares its parameters through FakeIpc."""
    from rollout_svc.engine import sglang_export_worker
    from tests.unit.weightsync.bus.ipc.test_trainer_writes import FakeIpc

    fake = FakeIpc()
    monkeypatch.setattr(sglang_export_worker, "share_storage", fake.share)
    monkeypatch.setattr("rollout_svc.engine.sglang_weights._patch_reductions", lambda: None)
    return fake
