"""One style for the whole tree, enforced by the suite: `ruff format --check` and `ruff check`
(pyflakes, pycodestyle, isort, bugbear; settings in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    assert exe, "ruff is missing: pip install the test extra"
    return subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_tree_is_formatted():
    res = _ruff("format", "--check", ".")
    assert res.returncode == 0, "run `ruff format .`:\n" + res.stdout[-3000:] + res.stderr[-1000:]


def test_the_tree_passes_the_linter():
    res = _ruff("check", ".")
    assert res.returncode == 0, "run `ruff check --fix .` and fix the rest:\n" + res.stdout[-3000:] + res.stderr[-1000:]


def test_a_violation_fails_the_check(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    res = _ruff("check", "--config", str(REPO / "pyproject.toml"), str(bad))
    assert res.returncode != 0 and "F401" in res.stdout, res.stdout


def test_test_modules_have_unique_basenames():
    # pytest imports test files by basename (no packages under tests/): two files of one name stop the
    # whole collection with "import file mismatch" in a clean clone
    seen: dict[str, list[str]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
