"""Fixtures of the Megatron tests; the checkpoint builders live in tests/support/megatron_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.support.megatron_models import FAMILIES, make_config, save_random_hf  # noqa: E402


@pytest.fixture(name="make_config")
def make_config_fixture():
    return make_config


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_random_hf(make_config(f), root / f, seed=i) for i, f in enumerate(FAMILIES)}
