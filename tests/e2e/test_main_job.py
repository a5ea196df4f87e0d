"""The README's first command, `./scripts/demo.sh`, run exactly as written from the repository root.

This is what a newcomer runs first on a fresh machine: it sets up `.venv`, runs the sync demo
(every rollout serves exactly the trainer's exported weights after each `wsctl sync`) and the RL
loop (reward must rise as synced weights reach the rollouts). It broke once without any test
noticing (a relative workdir was resolved a second time under the trainer's data root), so it runs
here with its default arguments and its output is checked line by line.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_COMMAND = "./scripts/demo.sh"


def test_readme_names_the_main_job_first():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no ```bash block"
    first = block.group(1).splitlines()[0].split("#")[0].strip()
    assert first == README_COMMAND, f"README's first command is {first!r}, this test runs {README_COMMAND!r}"


# demo.sh re-runs `pip install -e .` into the suite's own .venv: the package's console scripts and
# metadata are rewritten meanwhile, so under pytest-xdist no other test may run beside it
@pytest.mark.serial
def test_main_job_runs_as_written_and_learns():
    env = {k: v for k, v in os.environ.items() if k not in ("OUTDIR", "PYTHONPATH")}
    out = subprocess.run(["bash", "-c", README_COMMAND], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    tail = "\n".join(log.splitlines()[-60:])
    assert out.returncode == 0, f"{README_COMMAND} exited {out.returncode}:\n{tail}"
    assert "PASS: every rollout serves exactly the trainer's exported weights after each sync" in log, tail
    m = re.search(r"reward: first \d+ steps ([\d.]+) → last \d+ steps ([\d.]+) \(chance ([\d.]+)\)", log)
    assert m, f"no reward summary in the output:\n{tail}"
    first, last, chance = map(float, m.groups())
    assert first < 2 * chance and last >= first + 0.3, (first, last, chance)
    assert re.search(r"^PASS: reward rose by ", log, re.M), tail
    assert (ROOT / "runs" / "demo" / "rl.png").stat().st_size > 0
