"""Regenerate the `trainer.config` / `rollout.config` parts of the Helm chart's values.schema.json
from the services' config classes (trainer_svc/config.py TrainerConfig, rollout_svc/config.py
RolloutConfig): one property per settable field, with its type, choices, default and help.

The rest of the schema (the chart's own values) is kept as committed. tests/deploy/test_chart.py
regenerates the file into a temporary path and fails if it differs, so run this after adding,
renaming or changing a config field:

    python scripts/gen_helm_schema.py

Not settable through values, so absent from the schema: fields the chart sets itself (MANAGED:
listen addresses from `ports`, the token file from `auth`, the rollout's identity and trainer
address) and secret fields (`field(..., secret=True)`: the token comes from a Secret, never a value).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "deploy" / "helm" / "weightsync" / "values.schema.json"
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: the services' packages sit at the root

from rollout_svc.limits import AT_LEAST_ONE  # noqa: E402 (needs the path above)

#: role -> fields the chart's templates set (an entry that is not a field is an error)
MANAGED = {
    "trainer": ("grpc_address", "http_address", "auth_token_file", "insecure"),
    "rollout": (
        "grpc_address",
        "http_address",
        "data_address",
        "advertise_address",
        "advertise_data_host",
        "rollout_id",
        "trainer_address",
        "auth_token_file",
        "insecure",
    ),
}
_HOST_PORT = "^.+:[0-9]{1,5}$"
#: role -> field -> JSON-schema bounds that the config's validate() checks in code. The drift test
#: checks every numeric bound here against validate(): a value just past it must be refused.
BOUNDS: dict[str, dict[str, dict[str, Any]]] = {
    "trainer": {
        "model": {"minLength": 1},
        "device": {"pattern": "^(|cpu|cuda(:[0-9]+)?)$"},
        "tp": {"minimum": 1},
        "pp": {"minimum": 1},
        "vpp": {"minimum": 1},
        "ep": {"minimum": 1},
        "bucket_mb": {"minimum": 1, "maximum": 16384},
        "delta_link_gbps": {"minimum": 0},
        "nccl_init_timeout_s": {"exclusiveMinimum": 0},
        "sync_timeout_s": {"exclusiveMinimum": 0},
        "rpc_timeout_s": {"exclusiveMinimum": 0},
        "rollouts": {"items": {"pattern": _HOST_PORT}},
        "lr": {"exclusiveMinimum": 0},
        "lr_warmup_steps": {"minimum": 0},
        "grad_clip": {"minimum": 0},
    },
    "rollout": {
        "model": {"minLength": 1},
        "device": {"pattern": "^(cpu|cuda(:[0-9]+)?)$"},
        "tp": {"minimum": 1},
        "max_prefix_cache_entries": {"minimum": 0},
        "sync_timeout_s": {"exclusiveMinimum": 0},
        "register_timeout_s": {"minimum": 0},
        "heartbeat_s": {"minimum": 0},
        **{name: {"minimum": 1} for name in AT_LEAST_ONE},
    },
}
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}


def config_classes() -> dict[str, type]:
    from rollout_svc.config import RolloutConfig
    from trainer_svc.config import TrainerConfig

    return {"trainer": TrainerConfig, "rollout": RolloutConfig}


def settable(role: str, cls: type) -> list:
    """The leaf fields of `cls` that values may set, in declaration order."""
    from weightsync.config import leaf_fields

    fields = leaf_fields(cls)
    names = {f.name for f in fields}
    stale = sorted(set(MANAGED[role]) - names) + sorted(set(BOUNDS[role]) - names)
    if stale:
        raise SystemExit(
            f"scripts/gen_helm_schema.py: {role}: {stale} are not fields of {cls.__name__}; update MANAGED / BOUNDS"
        )
    return [f for f in fields if f.name not in MANAGED[role] and not f.metadata.get("secret")]


def config_schema(role: str, cls: type) -> dict[str, Any]:
    from weightsync.config import field_type, leaf_defaults

    defaults = leaf_defaults(cls)
    props: dict[str, Any] = {}
    for f in settable(role, cls):
        tp, is_list = field_type(f)
        if tp not in _JSON_TYPES:
            raise SystemExit(f"scripts/gen_helm_schema.py: {role}.{f.name}: no JSON type for {tp!r}")
        item: dict[str, Any] = {"type": _JSON_TYPES[tp]}
        if tp is dict:  # options passed through to another program, checked by the service at start
            item["additionalProperties"] = True
        if f.metadata.get("choices"):
            item["enum"] = list(f.metadata["choices"])
        bounds = dict(BOUNDS[role].get(f.name, {}))
        prop: dict[str, Any] = {"type": "array", "items": {**item, **bounds.pop("items", {})}} if is_list else item
        prop.update(bounds)
        prop["default"] = defaults[f.name]
        prop["description"] = f.metadata.get("help", "")
        props[f.name] = prop
    managed = ", ".join(MANAGED[role])
    return {
        "type": "object",
        "additionalProperties": False,
        "description": f"{cls.__name__} fields (generated by scripts/gen_helm_schema.py; do not edit by hand). "
        f"Set by the chart instead: {managed}; secret fields come from the auth Secret",
        "properties": props,
    }


def generate(base: dict[str, Any]) -> dict[str, Any]:
    """`base` (the committed schema) with both config sections regenerated."""
    out = json.loads(json.dumps(base))
    for role, cls in config_classes().items():
        out["properties"][role]["properties"]["config"] = config_schema(role, cls)
    return out


def dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=SCHEMA, help=f"where to write (default {SCHEMA.relative_to(ROOT)})")
    args = ap.parse_args()
    text = dumps(generate(json.loads(SCHEMA.read_text())))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
