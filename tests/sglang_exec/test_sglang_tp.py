"""Our loader at SGLang tp_size=2 on CPU, per pinned version (tp_checks.py: two processes, SGLang's own
parallel state and model classes): each rank's parameters are SGLang's own loader's, written by the slot table
from its shards; the ranks' sums combine into each bucket's checksum; each rank reads about half the bytes."""

from __future__ import annotations

import pytest

from rollout_svc.engine.sglang_api import CHECKED_VERSIONS
from tests.sglang_exec.tp_checks import FAMILIES
from tests.support.sglang_site import SiteUnavailable, run_in_sglang

_results: dict[str, dict] = {}


def _results_for(version: str) -> dict:
    if version not in _results:
        try:
            _results[version] = run_in_sglang(version, "tests.sglang_exec.tp_checks", timeout_s=500)
        except SiteUnavailable as exc:
            _results[version] = {"__skip__": str(exc)}
    return _results[version]


@pytest.mark.parametrize("version", CHECKED_VERSIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_tp_rank_takes_only_its_shard(version, family):
    res = _results_for(version)
    if "__skip__" in res:
        pytest.skip(res["__skip__"])
    name = f"tp2_shards[{family}]"
    assert res.get(name) == "ok", f"sglang {version}, {name}:\n{res.get(name)}"
