"""Principle 6: control plane and CLIs import neither megatron nor sglang; wsctl not even torch."""

import json
import subprocess
import sys

import pytest


def _modules_after(stmt: str) -> set[str]:
    code = f"import sys, json; {stmt}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_wsctl_imports_no_torch():
    mods = _modules_after("import weightsync.wsctl.cli")
    assert not {m for m in mods if m.split(".")[0] in ("torch", "megatron", "sglang", "transformers")}


@pytest.mark.parametrize(
    "stmt",
    [
        "import trainer_svc.cli, trainer_svc.service, weightsync.publisher",
        "import rollout_svc.cli, rollout_svc.service, rollout_svc.sync.transaction",
    ],
)
def test_services_import_no_megatron_or_sglang(stmt):
    mods = _modules_after(stmt)
    assert not {m for m in mods if m.split(".")[0] in ("megatron", "sglang")}
