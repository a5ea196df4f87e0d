"""SGLang's own code, importable on a CPU test machine: the pinned wheel unpacked into a cache
directory, its light pure-Python/CPU dependencies installed beside it, and the few CUDA-only or
frontend-only third-party modules stubbed.

sglang cannot be pip-installed with its dependencies here (it pins its own torch build and ~40
CUDA packages), so:
  * the wheel (downloaded with the same pip tags as the AST contract test, into the same cache)
    is unzipped into `<cache>/site-<version>/`;
  * `DEPS` are installed with `pip install --no-deps --target <cache>/deps-<hash>/`; they go at
    the END of sys.path so the test venv's own packages (torch 2.13 CPU, transformers, ...)
    always win;
  * `STUBS` (third-party only, never SGLang's own modules) resolve to empty modules;
  * sglang/__init__.py (the `sglang.lang` frontend DSL: IPython, aiohttp, tiktoken, ...) is not
    run: `sglang` is registered as a bare package over the unpacked directory, and everything
    the tests use lives under sglang.srt, which runs unmodified.

`activate()` changes the interpreter for good (sys.path, import hooks, environment): call it only
in a dedicated subprocess (`run_in_sglang`), never in the pytest process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import socket
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

CACHE_DIR = Path(os.environ.get("WEIGHTSYNC_SGLANG_CACHE", Path.home() / ".cache" / "weightsync" / "sglang"))
# Same tags as tests/unit/rollout_svc/engine/sglang/contract.py: 0.5.2x ships cp311 manylinux wheels only.
_PIP_TAGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--platform",
    "manylinux_2_34_x86_64",
]

# Third-party modules sglang.srt imports at module level that the tests' code paths never call
# into. Each is stubbed (an empty module whose attributes are empty modules), never installed.
STUBS = {
    "triton": "GPU kernel compiler; sglang.srt.utils.common and the layers import it unconditionally, "
    "the CPU code paths exercised here never launch a kernel",
    "tvm_ffi": "apache-tvm-ffi, loader of SGLang's JIT CUDA kernels (sglang.kernels.ops.*)",
    "sgl_kernel": "sglang-kernel, SGLang's compiled CUDA/CPU op library (a separate wheel built for torch 2.14); "
    "imported by sglang.srt.mem_cache.memory_pool when SGLANG_USE_CPU_ENGINE=1",
    "torchvision": "built for a specific torch; imported by multimodal configs (internvl_utils) only",
    "IPython": "notebook display helpers in sglang/utils.py (frontend logging), pulled in by configs",
}

# Installed in the test venv but absent from an SGLang deployment; SGLang probes for them with
# `try: import` and must see them missing (0.5.10's debug_utils/dumper.py imports megatron.core,
# which then trips over the triton stub).
HIDDEN = {"megatron": "the trainer's framework; SGLang's optional dumper plugin must find it absent"}

# Light dependencies sglang.srt really needs at import time, pinned; installed --no-deps.
DEPS = (
    "msgspec==0.22.0",
    "orjson==3.13.0",
    "pybase64==1.5.1",
    "psutil==7.2.2",
    "pyzmq==27.3.0",
    "dill==0.4.1",
    "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0",
    "loguru==0.7.3",
    "frozendict==2.5.1",
    "gguf==0.19.0",
    "openai==2.8.0",
    "jiter==0.19.0",
    "distro==1.9.0",
    "httpx==0.28.1",
    "httpcore==1.0.9",
    "h11==0.16.0",
    "sniffio==1.3.1",
    "partial-json-parser==0.2.1.1.post7",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "certifi==2026.10.18",
    "idna==3.20",
    "charset-normalizer==3.5.2",
    "starlette==1.10.0",
)


# What SGLang's Engine additionally imports (HTTP server stack, scheduler, grammar backend);
# only the CPU Engine e2e (tests/sglang_exec/engine_e2e.py) installs them. xgrammar needs the real
# tvm_ffi, so in that mode tvm_ffi is installed instead of stubbed.
ENGINE_DEPS = (
    "uvloop==0.22.1",
    "setproctitle==1.3.8",
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
    "apache-tvm-ffi==0.1.11",
    "xgrammar==0.2.7",
)


class SiteUnavailable(Exception):
    """PyPI cannot be reached and nothing is cached: the tier is skipped, not passed."""


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def _pip(args: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return
    if not pypi_reachable():
        raise SiteUnavailable(f"PyPI unreachable; cannot fetch {what} (cache: {CACHE_DIR})")
    raise RuntimeError(f"pip {' '.join(args[:2])} for {what} failed (PyPI is reachable):\n{proc.stderr[-2000:]}")


_lock_depth = [0]


@contextlib.contextmanager
def cache_lock(timeout: float = 900.0):
    """The cache is filled by one process at a time: pytest-xdist workers (and runs side by side) would
    otherwise download into, unzip into or pip-install into the same directory at once, and one could
    glob another's half-written wheel. Re-entrant within a process (site() takes it, then wheel())."""
    if _lock_depth[0]:
        _lock_depth[0] += 1
        try:
            yield
        finally:
            _lock_depth[0] -= 1
        return
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(CACHE_DIR / ".lock", "w") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{CACHE_DIR / '.lock'} held by another process for {timeout:.0f}s") from None
                time.sleep(0.1)
        _lock_depth[0] = 1
        try:
            yield
        finally:
            _lock_depth[0] = 0
            fcntl.flock(f, fcntl.LOCK_UN)


@cache_lock()
def wheel(version: str) -> Path:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    have = sorted(CACHE_DIR.glob(f"sglang-{version}-*.whl"))
    if not have:
        _pip(
            ["download", "--no-deps", "-q", *_PIP_TAGS, "-d", str(CACHE_DIR), f"sglang=={version}"],
            f"sglang=={version}",
        )
        have = sorted(CACHE_DIR.glob(f"sglang-{version}-*.whl"))
    return have[0]


@cache_lock()
def site(version: str) -> Path:
    """The unpacked wheel (idempotent; a marker file says the unpack finished)."""
    out = CACHE_DIR / f"site-{version}"
    if not (out / ".unpacked").is_file():
        whl = wheel(version)
        with zipfile.ZipFile(whl) as z:
            z.extractall(out)
        (out / ".unpacked").write_text(whl.name)
    return out


@cache_lock()
def deps(engine: bool = False) -> Path:
    pins = DEPS + (ENGINE_DEPS if engine else ())
    out = CACHE_DIR / ("deps-" + hashlib.sha256("\n".join(pins).encode()).hexdigest()[:12])
    if not (out / ".installed").is_file():
        _pip(["install", "--no-deps", "-q", "--target", str(out), *pins], "sglang's light dependencies")
        (out / ".installed").write_text("\n".join(pins))
    return out


def prepare(version: str, engine: bool = False) -> tuple[Path, Path]:
    return site(version), deps(engine)


_NO_DEVICE = {"triton.runtime.driver"}


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in _NO_DEVICE:
            # Code that probes for a GPU through triton (0.5.10's fla/utils.py) catches this and
            # falls back to "cpu", as it would with a real triton and no GPU.
            raise RuntimeError(f"{full}: stubbed, no GPU driver")
        mod = sys.modules.get(full)
        if mod is None:
            mod = _Stub(full)
            mod.__path__ = []
            sys.modules[full] = mod
        return mod

    def __call__(self, *args, **kwargs):  # decorators (@triton.jit) and factories
        return self

    def __mro_entries__(self, bases):  # `class X(triton.Something)`
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from SGLang here)", name=name)
        if name.split(".")[0] in STUBS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _Stub(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def activate(version: str, engine: bool = False) -> Path:
    """Make `import sglang.srt...` work in THIS process (a dedicated subprocess).

    engine=True: also what SGLang's Engine imports (ENGINE_DEPS; tvm_ffi real, not stubbed), and
    the triton stub reports a version (sglang.kernels.ops.mamba compares it at import)."""
    site_dir, deps_dir = prepare(version, engine)
    if engine:
        STUBS.pop("tvm_ffi", None)
    # SGLang's CPU platform switch (sglang.srt.utils.common.is_cpu); without it the layers take
    # the CUDA/vLLM branches.
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    # torch and transformers probe for triton / torchvision at import time; let them see the
    # truth before the stubs exist, or they would treat the stubs as real packages.
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._dynamo.repro.after_dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401
    import transformers.utils.import_utils  # noqa: F401

    sys.path.insert(0, str(site_dir))
    sys.path.append(str(deps_dir))
    sys.meta_path.insert(0, _StubFinder())
    if engine:
        import triton

        triton.__version__ = "3.4.0"
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(site_dir / "sglang")]
    pkg.__file__ = str(site_dir / "sglang" / "__init__.py")
    sys.modules["sglang"] = pkg
    return site_dir


RESULT_MARK = "SGLANG_EXEC_RESULTS "


def run_in_sglang(
    version: str, module: str, timeout_s: float = 300.0, engine: bool = False, args: tuple[str, ...] = ()
) -> dict:
    """Run `python -m <module> <version> [args]` (which prints RESULT_MARK + JSON) and return the JSON."""
    prepare(version, engine)  # download/unpack here, so a missing network is a skip in the caller
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    proc = subprocess.run(
        [sys.executable, "-m", module, version, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    raise RuntimeError(
        f"{module} {version} exited {proc.returncode} without results:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
