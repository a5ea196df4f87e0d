"""SGLang 0.5.10 imported on CPU as on a CUDA host (is_cuda() forced true) with the GPU harness's
sgl_kernel shim (tests/support/sgl_kernel_shim.py), or without it (`bare`) to show what it is for.
Run as `python -m tests.sglang_exec.shim_import <version> [bare]` (test_sgl_kernel_shim.py does);
prints RESULT_MARK + JSON.

Forcing is_cuda() here takes the module-level `if _is_cuda:` branches a GPU host takes (imports from
sgl_kernel, register_fake on sgl_kernel ops, JIT-kernel choices), which is what the shim must survive;
nothing is launched on a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from tests.support import sgl_kernel_shim, sglang_site


def _fake_cuda() -> None:
    import torch

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "forced is_cuda() on CPU"


def main(version: str, bare: bool) -> dict:
    res: dict = {}
    if not bare:
        sgl_kernel_shim.install()
        for name in sgl_kernel_shim.STUBBED:  # the shim stands in for these, not sglang_site's stubs
            sglang_site.STUBS.pop(name, None)
    sglang_site.activate(version, engine=True)
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # the CUDA branches, not SGLang's CPU engine
    _fake_cuda()
    try:
        from sglang.srt.entrypoints.engine import Engine  # noqa: F401

        res["import_engine"] = "ok"
    except BaseException:  # noqa: BLE001 — reported to the test
        res["import_engine"] = traceback.format_exc()[-1500:]
        return res
    import torch
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.managers import overlap_utils
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.model_executor import forward_batch_info

    res["clamp_position"] = forward_batch_info.clamp_position.__name__
    res["resolve_future_token_ids"] = overlap_utils._resolve_future_token_ids.__name__
    res["store_cache_used"] = memory_pool.can_use_store_cache(256)
    norm = RMSNorm(8, eps=1e-6)
    res["rmsnorm_forward"] = norm._forward_method.__name__
    x = torch.randn(3, 8)
    res["rmsnorm_ok"] = bool(torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
    from sgl_kernel import weak_ref_tensor

    try:
        weak_ref_tensor(x)
        res["missing_kernel_call"] = "returned"
    except NotImplementedError as exc:
        res["missing_kernel_call"] = str(exc)
    try:
        torch.ops.sgl_kernel.moe_fused_gate(x, x[0], 1, 1, 1, 0, 0.0, False)
        res["fake_registered_op_call"] = "returned"
    except NotImplementedError as exc:
        res["fake_registered_op_call"] = str(exc)
    return res


if __name__ == "__main__":
    out = main(sys.argv[1], bare=len(sys.argv) > 2 and sys.argv[2] == "bare")
    print(sglang_site.RESULT_MARK + json.dumps(out), flush=True)
