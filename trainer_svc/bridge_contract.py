"""The exact API of each optional converter bridge that weightsync calls, as data, and its check.

A bridge is a third-party package that moves fast; its API drifts between releases. Rather than
fail deep inside a sync with an AttributeError, the trainer checks at start-up that every symbol,
parameter and mapping key listed here exists in the installed package, and refuses to start with
a message naming the missing piece, the version it was pinned against and how to install that one.

Nothing here imports torch or a bridge at module level: `TrainerConfig.validate()` uses
`missing_package_error()`, which only asks `importlib` whether the package is installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Contract:
    converter: str  # the config value: converter=<this>
    module: str  # import name
    distribution: str  # pip distribution name, for importlib.metadata
    pinned: str  # the version this contract was read from
    install: str  # the command that installs a version that fits
    #: dotted path (from `module`) -> parameter names we pass by keyword or position; a **kwargs
    #: in the signature does not count, since it would swallow a renamed argument silently
    callables: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: dotted path -> items that must be `in` it (dict keys, list entries)
    contains: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: attributes we set on the bridge object we build; checked on the instance (`check_instance`)
    instance_attrs: tuple[str, ...] = ()


CONTRACTS: dict[str, Contract] = {
    # Read from mbridge-0.15.1-py3-none-any.whl (mbridge/core/{auto_bridge,bridge}.py).
    "mbridge": Contract(
        converter="mbridge",
        module="mbridge",
        distribution="mbridge",
        pinned="0.15.1",
        install="pip install 'mbridge[megatron]==0.15.1'",
        callables={
            "AutoBridge.from_config": ("hf_config",),
            "AutoBridge.list_supported_models": (),
            # from_config forwards its **kwargs to the registered bridge class's __init__
            "core.bridge.Bridge.__init__": ("hf_config", "dtype", "parallel_states", "make_vocab_size_divisible_by"),
            "core.bridge.Bridge.export_weights": ("models",),
            "core.bridge.Bridge.load_weights": ("models", "weights_path", "memory_efficient"),
        },
        contains={
            # the TE layer spec's fused-norm names, which the adapter aliases to the local spec's
            "core.bridge.Bridge._ATTENTION_MAPPING": ("self_attention.linear_qkv.layer_norm_weight",),
            "core.bridge.Bridge._MLP_MAPPING": ("mlp.linear_fc1.layer_norm_weight",),
            "core.bridge.Bridge._DIRECT_MAPPING": ("embedding.word_embeddings.weight", "output_layer.weight"),
            "core.bridge.Bridge._OTHER_MAPPING": (),
        },
        # get_model() sets these when mbridge builds the model; we build our own, so we set them
        instance_attrs=(
            "vocab_size",
            "padded_vocab_size",
            "make_vocab_size_divisible_by",
            "_ATTENTION_MAPPING",
            "_MLP_MAPPING",
            "_OTHER_MAPPING",
            "_DIRECT_MAPPING",
        ),
    ),
    # Read from megatron_bridge-0.6.2-py3-none-any.whl (megatron/bridge/models/conversion/
    # {auto_bridge,mapping_registry}.py). Not installable next to megatron-core 0.16.1 / Python 3.11,
    # so nothing but this contract is checked in CI (docs/conversion.md).
    "megatron-bridge": Contract(
        converter="megatron-bridge",
        module="megatron.bridge",
        distribution="megatron-bridge",
        pinned="0.6.2",
        install="pip install megatron-bridge==0.6.2  (Python 3.12; it needs a newer megatron-core than 0.16)",
        callables={
            "AutoBridge.from_hf_config": ("config",),
            "AutoBridge.supports": ("config",),
            "AutoBridge.export_hf_weights": ("model", "cpu", "show_progress"),
            "AutoBridge.load_hf_weights": ("model", "hf_path"),
        },
        contains={
            # what lets it convert a local-spec GPTModel (separate norm modules) at all
            "models.conversion.mapping_registry.MegatronMappingRegistry._SEPARATE_LAYERNORM_REWRITES": (
                ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
                ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
            ),
        },
    ),
}


class BridgeUnavailable(ValueError):
    """The configured converter bridge is not installed or does not match the pinned API."""


def contract_for(converter: str) -> Contract:
    if converter not in CONTRACTS:
        raise BridgeUnavailable(f"converter={converter!r} is not a bridge; known bridges: {sorted(CONTRACTS)}")
    return CONTRACTS[converter]


def installed_version(c: Contract) -> str | None:
    try:
        return importlib.metadata.version(c.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_package_error(converter: str) -> str | None:
    """A message if the bridge package is not installed (no import of it), else None."""
    c = contract_for(converter)
    try:
        found = importlib.util.find_spec(c.module) is not None
    except ModuleNotFoundError:  # a parent package (e.g. `megatron`) is missing altogether
        found = False
    if found:
        return None
    return (
        f"converter={converter!r} needs the {c.distribution} package, which is not installed: {c.install} "
        f"(or set converter=builtin)"
    )


def _resolve(root: ModuleType, dotted: str) -> Any:
    """`root`.a.b.c, importing submodules on the way (`mbridge.core.bridge` is not an attribute of
    `mbridge` until imported)."""
    obj: Any = root
    done = root.__name__
    for part in dotted.split("."):
        if not hasattr(obj, part) and isinstance(obj, ModuleType):
            try:
                importlib.import_module(f"{done}.{part}")
            except ImportError:
                pass
        if not hasattr(obj, part):
            raise AttributeError(f"{done} has no attribute {part!r}")
        obj = getattr(obj, part)
        done = f"{done}.{part}"
    return obj


def check_contract(c: Contract, root: ModuleType) -> list[str]:
    """Every way the imported package `root` departs from the contract, one line each."""
    problems = []
    for path, params in c.callables.items():
        full = f"{c.module}.{path}"
        try:
            fn = _resolve(root, path)
        except AttributeError as exc:
            problems.append(f"{full} is missing ({exc})")
            continue
        try:
            names = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError) as exc:
            problems.append(f"{full} has no inspectable signature ({exc})")
            continue
        missing = [p for p in params if p not in names]
        if missing:
            problems.append(f"{full} takes no parameter {', '.join(missing)} (has: {', '.join(sorted(names))})")
    for path, items in c.contains.items():
        full = f"{c.module}.{path}"
        try:
            holder = _resolve(root, path)
        except AttributeError as exc:
            problems.append(f"{full} is missing ({exc})")
            continue
        for item in items:
            if item not in holder:
                problems.append(f"{full} has no entry {item!r}")
    return problems


def check_instance(c: Contract, obj: Any) -> None:
    missing = [a for a in c.instance_attrs if not hasattr(obj, a)]
    if missing:
        raise BridgeUnavailable(
            _report(c, [f"{type(obj).__qualname__} instance has no attribute {a!r}" for a in missing])
        )


def _report(c: Contract, problems: list[str]) -> str:
    found = installed_version(c)
    return (
        f"converter={c.converter!r}: the installed {c.distribution} {found or '(unknown version)'} does not "
        f"match the API weightsync calls (pinned against {c.pinned}): "
        + "; ".join(problems)
        + f". Install the pinned version ({c.install}) or set converter=builtin"
    )


def require_bridge(converter: str) -> ModuleType:
    """Import the bridge and check its API against the contract; raise BridgeUnavailable naming
    what is missing. Heavy: imports the bridge (and through it megatron-core)."""
    c = contract_for(converter)
    err = missing_package_error(converter)
    if err:
        raise BridgeUnavailable(err)
    try:
        root = importlib.import_module(c.module)
    except ImportError as exc:
        raise BridgeUnavailable(f"converter={converter!r}: `import {c.module}` failed: {exc}. {c.install}") from exc
    problems = check_contract(c, root)
    if problems:
        raise BridgeUnavailable(_report(c, problems))
    return root
