"""Typed service configuration with one precedence rule: flags > env > file > defaults.

A service declares a dataclass made of sections (nested dataclasses, declared with `section()`)
whose leaf fields carry `help` (and optionally `choices`) metadata. Leaf names are unique across
a service's sections, so each knob keeps one flat name: the flag (`--bucket-mb`), the env variable
(`<PREFIX>_BUCKET_MB`), the YAML/JSON key (`bucket_mb`, or nested under its section:
`bus: {bucket_mb: ...}`) and the Helm value all name the same field, and `add_arguments` builds
the CLI from those same fields. In code a knob is reached through its section: `cfg.bus.bucket_mb`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


def field(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    default_factory: Any = dataclasses.MISSING,
    secret: bool = False,
) -> Any:
    """`secret`: settable from env, file or code but never a flag, so it never shows in a process list."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "secret": secret}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, **defaults: Any) -> Any:
    """A nested section of a service config; `defaults` override the section's own (e.g. ports)."""
    return dataclasses.field(default_factory=lambda: cls(**defaults), metadata={"section": cls})


def _is_section(f: dataclasses.Field) -> bool:
    return "section" in f.metadata


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) of a field annotation; Optional[X] is X; a mapping (`dict[str, Any]`,
    options passed through to another program) is `dict`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    if origin is dict or tp is dict:
        return dict, False
    return tp, False


def _option_value(text: str) -> Any:
    """A pass-through option's value as YAML reads a scalar: 0.6 is a float, 8192 an int, true a bool."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _parse_mapping(name: str, raw: Any) -> dict[str, Any]:
    """A mapping field from a file (a mapping), the env (a JSON object, or KEY=VALUE,KEY=VALUE) or
    flags (KEY=VALUE each)."""
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("{"):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{name}: {raw!r} is not a JSON object ({exc.msg})") from None
        else:
            raw = [x for x in text.split(",") if x.strip()]
    if isinstance(raw, (list, tuple)):
        out = {}
        for item in raw:
            key, sep, value = str(item).partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"{name}: {item!r} is not KEY=VALUE (e.g. mem_fraction_static=0.6)")
            try:
                out[key.strip()] = _option_value(value.strip())
            except ValueError as exc:  # an integer past int_max_str_digits
                raise ConfigError(f"{name}: {key.strip()}: {str(exc)[:200]}") from None
        raw = out
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: {raw!r} is not a mapping of option names to values")
    bad = [k for k in raw if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ConfigError(f"{name}: option name(s) {bad} are not identifiers")
    return dict(raw)


def _shown(raw: Any) -> str:
    """`raw` for a message, short: repr of a huge int raises (int_max_str_digits), a long text floods the log."""
    if isinstance(raw, int) and not isinstance(raw, bool) and raw.bit_length() > 256:
        return f"an integer of {raw.bit_length()} bits"
    text = repr(raw)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


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
    if isinstance(raw, bool) and tp in (int, float):  # YAML's `true` is a bool, which Python counts as 1
        raise ConfigError(f"{name}: {raw!r} is a boolean, not a {tp.__name__} (give a number)")
    try:
        value = tp(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {_shown(raw)} is not a valid {tp.__name__}") from None
    if tp is int and abs(value) >= 1 << 63:  # no count, size or port needs more; a 5000-digit one is an attack
        raise ConfigError(f"{name}: {_shown(raw)} is out of range (at most 2^63 - 1)")
    # float("nan") and float("inf") parse, but no timeout, rate or size is meaningful as either:
    # nan compares false with every bound a validate() checks, so it would slip through them all.
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{name}: {raw!r} is not a finite number (give a real value, e.g. 30)")
    return value


def _coerce(f: dataclasses.Field, raw: Any) -> Any:
    tp, is_list = _base_type(f.type)
    if raw is None:
        return None
    if tp is dict:
        return _parse_mapping(f.name, raw)
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


def _leaves(cls: type, base: Any = None) -> list[tuple[dataclasses.Field, Any]]:
    """(leaf field, its default) of every knob, sections flattened; a leaf name used twice is an error."""
    out: list[tuple[dataclasses.Field, Any]] = []
    for f in _fields(cls):
        if _is_section(f):
            out += _leaves(f.metadata["section"], f.default_factory() if base is None else getattr(base, f.name))
            continue
        if base is not None:
            default = getattr(base, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        out.append((f, default))
    names = [f.name for f, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TypeError(f"{cls.__name__}: leaf field(s) {dup} appear in two sections; flat names must be unique")
    return out


def leaf_fields(cls: type) -> list[dataclasses.Field]:
    """Every knob of a service config, sections flattened (each with its help/choices metadata)."""
    return [f for f, _ in _leaves(cls)]


def leaf_names(cls: type) -> list[str]:
    """The flat knob names of a service config (flags, env suffixes, file keys, Helm keys)."""
    return [f.name for f in leaf_fields(cls)]


def leaf_defaults(cls: type) -> dict[str, Any]:
    """Flat knob name -> its default, as the service's sections override them (e.g. its ports)."""
    return {f.name: default for f, default in _leaves(cls)}


def field_type(f: dataclasses.Field) -> tuple[Any, bool]:
    """(scalar type, is a list) of a leaf field from `leaf_fields`; Optional[X] is X."""
    return _base_type(f.type)


def require_positive(cfg: Any, names: typing.Iterable[str]) -> None:
    """Refuse any of the int fields `names` of `cfg` that is below 1, naming the field and its value."""
    for name in names:
        value = getattr(cfg, name)
        if value < 1:
            raise ConfigError(f"{name}={value} must be >= 1")


def validate_sections(cfg: Any) -> None:
    """Run each section's own `validate()`; the service's validate then checks across sections."""
    for name in sections(type(cfg)):
        check = getattr(getattr(cfg, name), "validate", None)
        if check is not None:
            check()


class ServiceConfig:
    """Base of a service's top-level config (a dataclass of sections)."""

    @classmethod
    def from_flat(cls, **values: Any):
        """Built from flat knob names (`bucket_mb=8`), as a file or the env would give them; not validated."""
        return build(cls, values)

    def validate(self) -> None:
        """Each section's own checks; a service adds the checks that span sections."""
        validate_sections(self)


def sections(cls: type) -> dict[str, type]:
    """Section name -> section class of a service config."""
    return {f.name: f.metadata["section"] for f in _fields(cls) if _is_section(f)}


def build(cls: type[C], values: typing.Mapping[str, Any]) -> C:
    """An instance of `cls` from flat leaf values (each placed in its section); others keep defaults."""
    kwargs: dict[str, Any] = {}
    for f in _fields(cls):
        if _is_section(f):
            base = f.default_factory()  # the section's defaults as this service overrides them
            kwargs[f.name] = dataclasses.replace(
                base, **{g.name: values[g.name] for g in _fields(type(base)) if g.name in values}
            )
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}_{field_name.upper()}"


def add_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str) -> None:
    """Add one flag per field; defaults are None so that 'not given' is distinguishable."""
    parser.add_argument(
        "--config",
        dest="config_file",
        default=None,
        help=f"YAML or JSON file of settings (env {env_prefix}_CONFIG); flags > env > file > defaults",
    )
    for f, default in _leaves(cls):
        if f.metadata.get("secret"):
            continue
        tp, is_list = _base_type(f.type)
        help_text = f"{f.metadata.get('help', '')} (env {env_name(env_prefix, f.name)}; default {default!r})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if tp is dict:  # one option per flag, repeatable: --sglang-arg mem_fraction_static=0.6
            help_text = f"{f.metadata.get('help', '')} (repeatable; env {env_name(env_prefix, f.name)} as JSON)"
            parser.add_argument(
                flag_name(f.name) + "-arg",
                dest=f.name,
                default=None,
                action="append",
                metavar="KEY=VALUE",
                help=help_text,
            )
            continue
        if tp is bool and not is_list:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = f.name.upper()
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag_name(f.name), **kwargs)


def _load_file_text(p: Path) -> Any:
    """The file's YAML (.yaml/.yml) or JSON; ConfigError naming the file and where it broke."""
    import yaml

    kind = "YAML" if p.suffix in (".yaml", ".yml") else "JSON"
    try:
        text = p.read_text(encoding="utf-8")
        return (yaml.safe_load(text) or {}) if kind == "YAML" else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p}: not valid {kind}: {str(exc)[:300]}") from None
    except ValueError as exc:  # an integer of more digits than Python converts (int_max_str_digits)
        raise ConfigError(f"config file {p}: a value cannot be read: {str(exc)[:200]}") from None
    except RecursionError:
        raise ConfigError(f"config file {p}: nested too deeply") from None


def _read_file(path: str, cls: type) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    data = _load_file_text(p)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping of field names to values")
    flat: dict[str, Any] = {}
    nested = sections(cls)
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key in nested and isinstance(v, dict):  # `bus: {bucket_mb: 8}` as well as `bucket_mb: 8`
            own = {f.name for f, _ in _leaves(nested[key])}
            for sk, sv in v.items():
                sub = str(sk).replace("-", "_")
                if sub not in own:
                    raise ConfigError(
                        f"config file {path}: {key}.{sub} is not a field of section {key}; its fields: {sorted(own)}"
                    )
                flat[sub] = sv
        else:
            flat[key] = v
    return flat


def resolve(
    cls: type[C], ns: argparse.Namespace, env_prefix: str, environ: typing.Mapping[str, str] | None = None
) -> C:
    environ = os.environ if environ is None else environ
    fields = [f for f, _ in _leaves(cls)]
    known = {f.name for f in fields}
    file_path = getattr(ns, "config_file", None) or environ.get(f"{env_prefix}_CONFIG")
    file_values = _read_file(file_path, cls) if file_path else {}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(f"config file {file_path}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    values: dict[str, Any] = {}
    for f in fields:
        raw: Any = None
        if _base_type(f.type)[0] is dict:  # options merge key by key: file < env < flags
            sources = [file_values.get(f.name), environ.get(env_name(env_prefix, f.name)), getattr(ns, f.name, None)]
            given = [_coerce(f, x) for x in sources if x is not None]
            if given:
                values[f.name] = {k: v for d in given for k, v in d.items()}
            continue
        if getattr(ns, f.name, None) is not None:
            raw = getattr(ns, f.name)
        elif env_name(env_prefix, f.name) in environ:
            raw = environ[env_name(env_prefix, f.name)]
        elif f.name in file_values:
            raw = file_values[f.name]
        else:
            continue
        values[f.name] = _coerce(f, raw)
    cfg = build(cls, values)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def parse_host_port(field_name: str, value: str) -> tuple[str, int]:
    """Parse 'host:port' (IPv6 as '[::1]:port'); errors name the field."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{field_name}: {value!r} is not host:port (e.g. 127.0.0.1:50051, [::]:50051)")
    return host.strip("[]"), int(port)
