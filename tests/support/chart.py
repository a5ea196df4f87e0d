"""The Helm chart rendered in-process (helm-python-sdk) and the chart's generator scripts loaded as
modules, for the deploy tests (tests/deploy)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "weightsync"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def render(values: dict) -> list[dict]:
    """The chart's manifests for `values` (checked against values.schema.json first)."""
    from helm_python import chart as helm

    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(values)
    out = chart.render(values, name="ws", namespace="rl", is_install=True)
    return [d for path, text in out.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]
