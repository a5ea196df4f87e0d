"""SGLang's own code on our payloads (not parsed: imported and executed), per pinned version.

Each version runs in one fresh interpreter (`python -m tests.sglang_exec.exec_checks <version>`) where
tests/support/sglang_site.py has put the unpacked wheel on sys.path; this module turns that
process's per-check results into one test each. What is stubbed and why: sglang_site.STUBS and
docs/sglang.md. Skipped (not passed) when PyPI is unreachable and nothing is cached.
"""

from __future__ import annotations

import pytest

from rollout_svc.engine.sglang_api import CHECKED_VERSIONS
from tests.sglang_exec.exec_checks import CHECKS
from tests.support.sglang_site import SiteUnavailable, run_in_sglang

# The two ends of the pinned range, as the AST contract test.
VERSIONS = CHECKED_VERSIONS

_results: dict[str, dict] = {}


def _results_for(version: str) -> dict:
    if version not in _results:
        try:
            _results[version] = run_in_sglang(version, "tests.sglang_exec.exec_checks")
        except SiteUnavailable as exc:
            _results[version] = {"__skip__": str(exc)}
    return _results[version]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("check", list(CHECKS))
def test_sglang_receives_our_payload(version, check):
    res = _results_for(version)
    if "__skip__" in res:
        pytest.skip(res["__skip__"])
    assert check in res, f"check {check} did not run in sglang {version}"
    assert res[check] == "ok", f"sglang {version}, {check}:\n{res[check]}"
