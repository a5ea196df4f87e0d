"""CI-optional: SGLang's real Engine on CPU behind the adapter (tests/sglang_exec/engine_e2e.py).

Opt in with WEIGHTSYNC_SGLANG_ENGINE_E2E=1: it installs SGLang's server-side imports as well
(sglang_site.ENGINE_DEPS, ~25 MB once) and takes ~2-3 min on a 2-core machine.
"""

from __future__ import annotations

import os

import pytest

from tests.support.sglang_site import SiteUnavailable, run_in_sglang

pytestmark = pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_SGLANG_ENGINE_E2E") != "1",
    reason="SGLang CPU Engine e2e is opt-in: set WEIGHTSYNC_SGLANG_ENGINE_E2E=1",
)

CHECKS = (
    "generate_and_score_before_sync",
    "generate_cancelled",
    "generate_streamed",
    "generate_concurrent",
    "sync_named_cpu_path",
    "sync_flattened_bucket_path",
    "sync_our_loader_then_export",
)
_results: dict = {}


@pytest.mark.parametrize("check", CHECKS)
def test_sglang_engine_on_cpu(check):
    if not _results:
        try:
            _results.update(run_in_sglang("0.5.23", "tests.sglang_exec.engine_e2e", timeout_s=900, engine=True))
        except SiteUnavailable as exc:
            _results["__skip__"] = str(exc)
    if "__skip__" in _results:
        pytest.skip(_results["__skip__"])
    assert _results.get(check, "did not run").startswith("ok"), f"{check}:\n{_results.get(check)}"
