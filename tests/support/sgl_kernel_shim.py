"""Test/bench harness only (never imported by the product): lets SGLang 0.5.10's real `Engine` run
on a CUDA host where SGLang's compiled kernel library (`sgl_kernel`, the `sglang-kernel` wheel, built
for SGLang's own torch) and flashinfer cannot be installed.

What `install()` does, in every interpreter that imports SGLang (the rollout and SGLang's spawned
scheduler/detokenizer processes: see tests/support/sglang_gpu_site/sitecustomize.py):

* `sgl_kernel` (and every submodule) resolves to a module whose every attribute is a `Missing`
  kernel: importing a name works (SGLang imports dozens at module level under `if is_cuda()`), and
  CALLING one raises NotImplementedError naming it. The live run therefore proves that none of
  them was called.
* `flashinfer` and `IPython` resolve to the same kind of module; `SGLANG_IS_FLASHINFER_AVAILABLE=false`
  keeps SGLang from choosing flashinfer paths because the stub's import spec exists.
* The `sgl_kernel::*` torch ops that SGLang registers fake kernels for unconditionally on CUDA
  (`torch.library.register_fake`, not `register_fake_if_exists`) are defined with their schema
  and an implementation that raises (`FAKE_REGISTERED_OPS`).
* `ROUTES`: after each listed SGLang module is imported, the CUDA-kernel entry points it chose are
  replaced by SGLang's OWN native/Triton fallback from the same module (nothing is reimplemented):
  every `MultiPlatformOp` (RMSNorm, SiluAndMul, RotaryEmbedding, ...) dispatches to its
  `forward_native`, and the three JIT (tvm-ffi/nvcc) kernels on a dense model's path go to the
  torch code SGLang uses on other platforms.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types

STUBBED = {
    "sgl_kernel": "SGLang's compiled CUDA op library (sglang-kernel wheel, built against SGLang's torch, "
    "not the host's 2.11)",
    "flashinfer": "compiled attention/sampling library; imported at module level by sglang.srt.layers.sampler",
    "IPython": "notebook helpers imported by sglang/utils.py (frontend)",
}

# op name -> schema (sgl-kernel's own registration). SGLang 0.5.10 calls
# torch.library.register_fake on these at import time when is_cuda(): the op must exist.
FAKE_REGISTERED_OPS = {
    "moe_fused_gate": "moe_fused_gate(Tensor input_tensor, Tensor bias, int num_expert_group, int topk_group, "
    "int topk, int num_fused_shared_experts=0, float routed_scaling_factor=0., "
    "bool apply_routed_scaling_factor_on_output=False) -> Tensor[]",
}

ENV = {
    # engine._set_envs_and_config asserts the sglang-kernel package version on CUDA
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
    "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
}


def _route_multi_platform(mod) -> None:
    def dispatch_forward(self):
        return self.forward_native

    mod.MultiPlatformOp.dispatch_forward = dispatch_forward


def _route_attr(target: str, native: str):
    def patch(mod) -> None:
        setattr(mod, target, getattr(mod, native))

    return patch


def _no_store_cache(mod) -> None:
    # _set_kv_buffer_impl then takes its own `k_cache[indices] = k` fallback
    mod.can_use_store_cache = lambda row_bytes: False


# module -> (what is routed, patch). Listed in docs/sglang.md ("GPU harness").
ROUTES = {
    "sglang.srt.layers.utils.multi_platform": (
        "MultiPlatformOp.dispatch_forward -> forward_native (RMSNorm, SiluAndMul, RotaryEmbedding, ...)",
        _route_multi_platform,
    ),
    "sglang.srt.model_executor.forward_batch_info": (
        "clamp_position: JIT clamp_position_cuda -> _clamp_position_native",
        _route_attr("clamp_position", "_clamp_position_native"),
    ),
    "sglang.srt.managers.overlap_utils": (
        "_resolve_future_token_ids: JIT resolve_future_token_ids_cuda -> _resolve_future_token_ids_native",
        _route_attr("_resolve_future_token_ids", "_resolve_future_token_ids_native"),
    ),
    "sglang.srt.mem_cache.memory_pool": (
        "can_use_store_cache -> False: JIT store_cache -> SGLang's indexed-assignment fallback",
        _no_store_cache,
    ),
}

_LIBS: list = []  # torch.library.Library objects must stay alive
_ops_lock = threading.Lock()


class Missing:
    """A kernel of a stubbed library: importable, never callable."""

    def __init__(self, path: str):
        self._path = path

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._path}: not available on this host ({self._path.split('.')[0]} is stubbed by "
            "tests/support/sgl_kernel_shim.py); route its caller to SGLang's native path in ROUTES"
        )

    def __mro_entries__(self, bases):  # `class X(sgl_kernel.Something)`
        return (object,)

    def __repr__(self):
        return f"<Missing {self._path}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        return Missing(full)


def define_ops() -> None:
    """Define FAKE_REGISTERED_OPS in the `sgl_kernel` torch namespace (idempotent)."""
    import torch

    with _ops_lock:
        if _LIBS:
            return
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        for name, schema in FAKE_REGISTERED_OPS.items():
            if hasattr(torch.ops.sgl_kernel, name):
                continue
            lib.define(schema)

            def impl(*args, _name=name, **kwargs):
                return Missing(f"torch.ops.sgl_kernel.{_name}")()

            lib.impl(name, impl, "CompositeExplicitAutograd")
        _LIBS.append(lib)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        root = name.split(".")[0]
        if root in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if root == "sglang":
            define_ops()  # before any SGLang module can reach a register_fake
        if name in ROUTES:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, ROUTES[name][1])
            return spec
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        if spec.name == "IPython.display":
            mod.HTML = mod.display = lambda *a, **k: None
        return mod

    def exec_module(self, module):
        pass


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install() -> None:
    """Idempotent; must run before anything imports sglang (sitecustomize does it)."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if not installed():
        sys.meta_path.insert(0, _Finder())
