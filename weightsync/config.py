"""Typed service configuration with one precedence rule: flags > env > file > defaults.

A service declares a dataclass whose fields carry `help` (and optionally `choices`) metadata;
`load_config` builds the argparse CLI from those same fields, so `--help`, the env variables
(`<PREFIX>_<FIELD>`), the YAML/JSON file keys and the Helm chart all name one set of knobs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


def field(default: Any = dataclasses.MISSING, *, help: str, choices: Sequence[str] | None = None,
          default_factory: Any = dataclasses.MISSING) -> Any:
    meta = {"help": help, "choices": tuple(choices) if choices else None}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) of a field annotation; Optional[X] is X."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    return tp, False


def _parse_scalar(name: str, tp: Any, raw: Any) -> Any:
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}: {raw!r} is not a boolean (use true/false)")
    try:
        return tp(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {raw!r} is not a valid {tp.__name__}") from None


def _coerce(f: dataclasses.Field, raw: Any) -> Any:
    tp, is_list = _base_type(f.type)
    if raw is None:
        return None
    if is_list:
        items = raw if isinstance(raw, (list, tuple)) else [s for s in str(raw).split(",") if s.strip()]
        return [_parse_scalar(f.name, tp, x.strip() if isinstance(x, str) else x) for x in items]
    value = _parse_scalar(f.name, tp, raw)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{f.name}: {value!r} is not one of {list(choices)}")
    return value


def _fields(cls: type) -> list[dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        f.type = hints[f.name]
        out.append(f)
    return out


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}_{field_name.upper()}"


def add_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str) -> None:
    """Add one flag per field; defaults are None so that 'not given' is distinguishable."""
    parser.add_argument("--config", dest="config_file", default=None,
                        help=f"YAML or JSON file of settings (env {env_prefix}_CONFIG); flags > env > file > defaults")
    for f in _fields(cls):
        tp, is_list = _base_type(f.type)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f"{f.metadata.get('help', '')} (env {env_name(env_prefix, f.name)}; default {default!r})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if tp is bool and not is_list:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = f.name.upper()
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag_name(f.name), **kwargs)


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml
        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping of field names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def resolve(cls: type[C], ns: argparse.Namespace, env_prefix: str,
            environ: typing.Mapping[str, str] | None = None) -> C:
    environ = os.environ if environ is None else environ
    fields = _fields(cls)
    known = {f.name for f in fields}
    file_path = getattr(ns, "config_file", None) or environ.get(f"{env_prefix}_CONFIG")
    file_values = _read_file(file_path) if file_path else {}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(f"config file {file_path}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    values: dict[str, Any] = {}
    for f in fields:
        raw: Any = None
        if getattr(ns, f.name, None) is not None:
            raw = getattr(ns, f.name)
        elif env_name(env_prefix, f.name) in environ:
            raw = environ[env_name(env_prefix, f.name)]
        elif f.name in file_values:
            raw = file_values[f.name]
        else:
            continue
        values[f.name] = _coerce(f, raw)
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def parse_host_port(field_name: str, value: str) -> tuple[str, int]:
    """Parse 'host:port' (IPv6 as '[::1]:port'); errors name the field."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{field_name}: {value!r} is not host:port (e.g. 127.0.0.1:50051, [::]:50051)")
    return host.strip("[]"), int(port)
