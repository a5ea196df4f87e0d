"""The SGLang adapter's contract with the real sglang package (wheels from PyPI, parsed, not imported).

SGLang cannot be installed here (it pins its own torch/CUDA kernels), so these tests are what
stands between the adapter and a renamed method or keyword: every entry of SGLANG_API_USED must
exist in each checked sglang version, and the adapter must use nothing the table lacks.
"""

from __future__ import annotations

import pickle
import pickletools
from pathlib import Path

import pytest

from rollout_svc.engine import sglang_api
from rollout_svc.engine.sglang_api import CHECKED_VERSIONS, SGLANG_API_USED, SGLANG_IMPORTS, ApiUse

from .contract import SglangSource, WheelUnavailable, check_use, fetch_wheel, scan_adapter, usage_problems

ADAPTER = Path(sglang_api.__file__).parent
# The adapter's code; sglang_api.py is the table itself (data, no calls).
ADAPTER_MODULES = sorted(p for p in ADAPTER.glob("sglang_*.py") if p.name != "sglang_api.py")


@pytest.fixture(scope="module", params=CHECKED_VERSIONS)
def src(request) -> SglangSource:
    try:
        return SglangSource(fetch_wheel(request.param))
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


def test_required_api_exists(src):
    problems = [p for key, use in SGLANG_API_USED.items() if not use.optional for p in check_use(src, key, use)]
    assert not problems, f"{src.wheel.name}:\n" + "\n".join(problems)


#: optional entries the adapter imports under `try: ... except ImportError` (one place per version)
IMPORT_PROBED = {"LocalSerializedTensor (0.5.10)", "LocalSerializedTensor (0.5.2x)"}


def test_optional_api_is_probed_at_run_time(src):
    """Optional entries may be missing in a version, but only if the adapter guards them with hasattr (or, for
    a class that moved, imports it under try/except ImportError: IMPORT_PROBED)."""
    probes = {m for path in ADAPTER_MODULES for m, _ in scan_adapter(path.read_text(), str(path)).probes}
    probes |= IMPORT_PROBED
    for key, use in SGLANG_API_USED.items():
        if use.optional:
            assert key in probes, f"{key} is optional but the adapter never checks hasattr for it"
        elif key in probes:
            pytest.fail(f"{key} is probed with hasattr but declared required; mark it optional")


def test_optional_api_matrix_is_what_docs_say(src):
    """The compatibility matrix in docs/sglang.md is this table; keep them in step."""
    version = src.wheel.name.split("-")[1]
    expected_missing = {
        "0.5.10": {"Engine.begin_weight_update", "Engine.end_weight_update", "LocalSerializedTensor (0.5.2x)"},
        "0.5.23": {"LocalSerializedTensor (0.5.10)"},
    }
    missing = {k for k, u in SGLANG_API_USED.items() if u.optional and check_use(src, k, u)}
    assert missing == expected_missing[version]


def test_imports_exist(src):
    for (mod, name), key in SGLANG_IMPORTS.items():
        assert key in SGLANG_API_USED, f"import {mod}.{name} backs unknown entry {key}"
        if key in IMPORT_PROBED and check_use(src, key, SGLANG_API_USED[key]):
            continue  # absent in this version: imported under try/except ImportError
        tree = src.module(mod)
        assert tree is not None, f"{src.wheel.name}: module {mod} missing"
        # Defined there, imported there, or star-re-exported from a module that defines it.
        if src.find_class(mod, name) or _defines(src, mod, name):
            continue
        pytest.fail(f"{src.wheel.name}: {mod} does not provide {name}")


def _defines(src: SglangSource, mod: str, name: str, depth: int = 0) -> bool:
    import ast

    tree = src.module(mod)
    if tree is None or depth > 4:
        return False
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            return True
        if isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == name for a in n.names):
            return True
        if (
            isinstance(n, ast.ImportFrom)
            and any(a.name == "*" for a in n.names)
            and n.module
            and _defines(src, n.module, name, depth + 1)
        ):
            return True
    return False


def test_adapter_uses_only_the_table():
    assert {p.name for p in ADAPTER_MODULES} >= {"sglang_engine.py", "sglang_weights.py"}
    problems = []
    for path in ADAPTER_MODULES:
        u = scan_adapter(path.read_text(), str(path))
        problems += [f"{path.name} {p}" for p in usage_problems(u, SGLANG_API_USED, SGLANG_IMPORTS)]
    assert not problems, "\n".join(problems)


def test_adapter_scan_sees_the_main_calls():
    """Guard against a scanner that silently sees nothing."""
    members = set()
    for path in ADAPTER_MODULES:
        members |= {m for m, _, _ in scan_adapter(path.read_text(), str(path)).members}
    assert {
        "Engine.generate",
        "Engine.update_weights_from_distributed",
        "Engine.update_weights_from_tensor",
        "Engine.init_weights_update_group",
        "Engine.flush_cache",
        "Engine.release_memory_occupation",
        "TokenizerManager.pause_generation",
    } <= members


# ---- the checks can fail ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "use",
    [
        ApiUse("method", "sglang.srt.entrypoints.engine", "Engine", "update_weights_from_nowhere"),
        ApiUse("method", "sglang.srt.entrypoints.engine", "Engine", "generate", params=("input_ids", "made_up_kw")),
        ApiUse(
            "fields", "sglang.srt.managers.io_struct", "UpdateWeightsFromDistributedReqInput", params=("bucket_id",)
        ),
        ApiUse("server_args", "sglang.srt.server_args", "ServerArgs", params=("tp_size", "warp_drive")),
        ApiUse("attribute", "sglang.srt.entrypoints.engine", "Engine", "weight_bus"),
        ApiUse("class", "sglang.srt.entrypoints.engine", "EngineThatIsNot"),
        ApiUse("function", "sglang.srt.utils.patch_torch", "", "monkey_patch_everything"),
        ApiUse("literal", "sglang.srt.managers", "", params=("output_token_logprobz",)),
        ApiUse("unpickle", "sglang.srt.utils.common", "SafeUnpickler", params=("os:system",)),
        ApiUse("method", "sglang.srt.no_such_module", "Engine", "generate"),
        # Engine reads self.tokenizer_manager in many ways, and never reads a self.weight_bus
        ApiUse("attribute_uses", "sglang.srt.entrypoints.engine", "Engine", "tokenizer_manager", ("flush_cache",)),
        ApiUse("attribute_uses", "sglang.srt.entrypoints.engine", "Engine", "weight_bus", ("run_until_complete",)),
    ],
)
def test_checker_rejects_fabricated_api(src, use):
    assert check_use(src, "fabricated", use), f"{use} was accepted by {src.wheel.name}"


def test_scanner_rejects_undeclared_use():
    bad = """
import sglang
from sglang.srt.entrypoints.engine import Engine, Secret

class X:
    def f(self):
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
        self._sgl.update_weights_via_magic(names=[])
        self._call(self._sgl.update_weights_from_distributed, names=[], bucket=3)
        self._sgl.tokenizer_manager.secret_pause()
        FlattenedTensorMetadata(name="x", stride=(1,))
        Engine(model_path="m", turbo=True)
        hasattr(self._sgl, "teleport")
        return out["meta_info"]["secret_key"]
"""
    problems = "\n".join(usage_problems(scan_adapter(bad), SGLANG_API_USED, SGLANG_IMPORTS))
    for needle in (
        "module import time",
        "Secret",
        "Engine.update_weights_via_magic",
        "bucket=",
        "TokenizerManager.secret_pause",
        "stride=",
        "turbo=",
        "Engine.teleport",
        "'secret_key'",
    ):
        assert needle in problems, f"{needle!r} not reported:\n{problems}"


# ---- payloads pickle only what SGLang's SafeUnpickler allows -----------------------------------
class _Handle:
    device, device_uuid = 0, "GPU-00000000-0000-0000-0000-000000000000"
    handle, storage_size, storage_offset = b"h" * 64, 1 << 20, 0
    ref_counter_handle, ref_counter_offset, event_handle, event_sync_required = b"r", 0, b"e" * 64, True


def _globals_in(payload: bytes) -> set[str]:
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(payload):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            out.add(f"{strings[-2]}:{strings[-1]}")
        elif op.name == "GLOBAL":
            out.add(arg.replace(" ", ":"))
    return out


def test_ipc_payload_uses_allowed_globals(src):
    """The colocated payload is built without opening the handle; what it pickles must unpickle in SGLang."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from rollout_svc.engine.sglang_weights import _IpcTensor

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump({"flattened_tensor": _IpcTensor(_Handle(), 4096)})
    used = _globals_in(buf.getvalue())
    assert "torch.multiprocessing.reductions:rebuild_cuda_tensor" in used
    check = ApiUse("unpickle", "sglang.srt.utils.common", "SafeUnpickler", params=tuple(sorted(used)))
    assert not check_use(src, "ipc payload", check)
    declared = set(SGLANG_API_USED["SafeUnpickler"].params)
    assert used <= declared, f"payload pickles globals the table does not declare: {used - declared}"


def test_ipc_rebuild_argument_layout(src):
    """_IpcTensor hand-builds rebuild_cuda_tensor's arguments; SGLang rewrites argument 6 (device)."""
    import ast
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from rollout_svc.engine.sglang_weights import _IpcTensor

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(params) == 15 and params[6] == "storage_device" and params[7] == "storage_handle"
    consts = {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in src.module("sglang.srt.utils.patch_torch").body
        if isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Name)
        and n.targets[0].id == "_REDUCE_TENSOR_ARG_DEVICE_INDEX"
    }
    assert consts == {"_REDUCE_TENSOR_ARG_DEVICE_INDEX": 6}
    _, args = _IpcTensor(_Handle(), 4096).__reduce__()
    assert len(args) == 15 and args[6] == _Handle.device_uuid and args[7] == _Handle.handle and args[1] == (4096,)
