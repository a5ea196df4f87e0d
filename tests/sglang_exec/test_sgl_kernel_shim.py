"""The GPU harness's sgl_kernel shim (tests/support/sgl_kernel_shim.py; bench/sglang_live.sh uses it on a
CUDA host) against SGLang 0.5.10's own code on CPU, with SGLang's CUDA branches forced
(tests/sglang_exec/shim_import.py). Skipped (not passed) when PyPI is unreachable and nothing is cached."""

from __future__ import annotations

import re

import pytest

from tests.support import sgl_kernel_shim
from tests.support.sglang_site import SiteUnavailable, run_in_sglang, site

VERSION = "0.5.10"  # the version the live GPU run carries
# torch.library.register_fake on sgl_kernel ops in these files runs only on SGLang's CPU engine
CPU_ONLY = ("model_executor/cpu_graph_runner.py", "model_executor/model_runner.py")


def _run(*extra: str) -> dict:
    try:
        return run_in_sglang(VERSION, "tests.sglang_exec.shim_import", timeout_s=600, engine=True, args=extra)
    except SiteUnavailable as exc:
        pytest.skip(str(exc))


def test_every_op_sglang_registers_a_fake_for_on_cuda_is_defined():
    try:
        root = site(VERSION) / "sglang" / "srt"
    except SiteUnavailable as exc:
        pytest.skip(str(exc))
    needed = set()
    for f in root.rglob("*.py"):
        if str(f.relative_to(root)) in CPU_ONLY:
            continue
        # register_fake_if_exists skips an absent op; plain register_fake needs it
        needed |= set(re.findall(r"torch\.library\.register_fake\(\s*\"sgl_kernel::(\w+)\"", f.read_text()))
    assert needed and needed <= set(sgl_kernel_shim.FAKE_REGISTERED_OPS), needed - set(
        sgl_kernel_shim.FAKE_REGISTERED_OPS
    )


def test_without_the_shim_sglang_does_not_import_on_a_cuda_host():
    res = _run("bare")
    assert "sgl_kernel" in res["import_engine"] and res["import_engine"] != "ok", res["import_engine"]


def test_with_the_shim_sglang_imports_and_takes_its_own_native_paths():
    res = _run()
    assert res["import_engine"] == "ok", res["import_engine"]
    assert res["clamp_position"] == "_clamp_position_native"
    assert res["resolve_future_token_ids"] == "_resolve_future_token_ids_native"
    assert res["store_cache_used"] is False
    assert res["rmsnorm_forward"] == "forward_native" and res["rmsnorm_ok"] is True
    assert res["missing_kernel_call"].startswith("sgl_kernel.weak_ref_tensor: not available"), res
    assert "torch.ops.sgl_kernel.moe_fused_gate" in res["fake_registered_op_call"], res
