"""The package layering in pyproject.toml's [tool.importlinter] contracts holds (run by lint-imports)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _lint_imports(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports is missing: pip install the test extra (import-linter)"
    # this checkout's packages, not whichever copy the environment has installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([exe, "--no-cache", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    res = _lint_imports()
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout and "KEPT" in res.stdout, res.stdout[-2000:]


def test_a_broken_contract_fails_the_check(tmp_path):
    # the same runner on a contract the code breaks (the pipeline imports the bucket plan)
    cfg = tmp_path / "contracts.toml"
    cfg.write_text(
        '[tool.importlinter]\nroot_packages = ["weightsync"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "deliberately broken"\ntype = "forbidden"\n'
        'source_modules = ["weightsync.bus.pipeline"]\nforbidden_modules = ["weightsync.bus.plan"]\n'
    )
    res = _lint_imports("--config", str(cfg))
    assert res.returncode != 0 and "deliberately broken BROKEN" in res.stdout, res.stdout[-2000:]


def test_the_product_never_imports_the_tests():
    """Test stand-ins live under tests/ (import-linter's root packages do not include it, so this
    is checked here): the product may name a test module in an env hook, never import one."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+tests(\.|\s|$)", re.M)
    offenders = [
        str(p.relative_to(REPO))
        for pkg in ("weightsync", "trainer_svc", "rollout_svc")
        for p in (REPO / pkg).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert offenders == []
