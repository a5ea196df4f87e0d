"""README.md's "Running the services yourself" block, run as written.

The commands are read from the README (not copied here), so a README command that breaks fails
this test (e.g. `wsctl ... sync --json`, which once failed because `--json` was accepted only
before the subcommand). They run in bash from the repository root on the README's own ports; only
if one of those ports is taken on this machine are all four moved to free ports. The two `&`
lines are started first and the rest run once both services answer, as a person would wait.
The fresh-machine commands at the top run elsewhere: `./scripts/demo.sh` in tests/e2e/test_main_job.py,
`./scripts/test.sh` as CI itself (.ci/run; here it would be this very suite).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from weightsync.local.procs import free_port, http_get, wait_registered

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Running the services yourself"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md lost its section {SECTION!r}"
    block = re.search(r"```bash\n(.*?)```", text[text.index(SECTION) :], re.S)
    assert block, f"no ```bash block under {SECTION!r}"
    joined = re.sub(r"\\\n\s*", " ", block.group(1))  # backslash continuations
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ports(cmds: list[str]) -> list[int]:
    return sorted({int(p) for c in cmds for p in re.findall(r"127\.0\.0\.1:(\d+)", c)})


def _activation(cmds: list[str]) -> str:
    """The README's venv line; where this checkout has no .venv (a dev tree), the running venv's."""
    act = [c for c in cmds if c.startswith(". ") or c.startswith("source ")]
    assert act == [cmds[0]], "the block should start by activating the venv"
    if (ROOT / ".venv/bin/activate").is_file():
        return act[0]
    return f". {Path(sys.prefix) / 'bin/activate'}"


def _bash(line: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f"set -o pipefail; {line}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_readme_service_commands_run_as_written(tmp_path):
    cmds = readme_commands()
    ports = _ports(cmds)
    assert len(ports) == 4, ports
    if not all(_port_free(p) for p in ports):  # someone else is using them: same commands, other ports
        subst = {p: free_port() for p in ports}
        cmds = [re.sub(r"(?<=:)(\d+)\b", lambda m: str(subst.get(int(m.group(1)), m.group(1))), c) for c in cmds]
        ports = [subst[p] for p in ports]
    activate, rest = _activation(cmds), cmds[1:]
    background = [c[:-1].strip() for c in rest if c.endswith("&")]
    foreground = [c for c in rest if not c.endswith("&")]
    assert len(background) == 2 and foreground
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
    }
    procs = []
    try:
        for i, c in enumerate(background):
            log = (tmp_path / f"bg{i}.log").open("w")
            procs.append(
                subprocess.Popen(
                    ["bash", "-c", f"{activate} && exec {c}"],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        http_ports = [int(m) for c in background for m in re.findall(r"--http-address 127\.0\.0\.1:(\d+)", c)]
        deadline = time.monotonic() + 180
        for hp in http_ports:
            while True:
                dead = [p for p in procs if p.poll() is not None]
                assert not dead, "a README service exited:\n" + "\n".join(
                    (tmp_path / f"bg{i}.log").read_text()[-3000:] for i in range(len(procs))
                )
                try:
                    if http_get(hp, "/readyz", timeout=1)[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"service on http port {hp} not ready"
                time.sleep(0.3)
        trainer_addr = re.search(r"--address (\S+)", foreground[0]).group(1)
        wait_registered(trainer_addr, [re.search(r"--grpc-address (\S+)", background[1]).group(1)])
        outputs = {}
        for c in foreground:
            res = _bash(f"{activate} && {c}", env)
            assert res.returncode == 0, f"README command failed ({res.returncode}): {c}\n{res.stdout}\n{res.stderr}"
            assert "Traceback" not in res.stderr, res.stderr
            outputs[c] = res.stdout
        status = next(out for c, out in outputs.items() if c.endswith("status"))
        assert status.startswith("trainer  version")
        report = json.loads(next(out for c, out in outputs.items() if "sync" in c and "--json" in c))
        assert report["ok"] is True and len(report["rollouts"]) == 1
        metric = next(out for c, out in outputs.items() if c.startswith("curl"))
        served = re.search(r"^weightsync_weights_version(?:\{[^}]*\})? (\S+)$", metric, re.M)
        assert served and float(served.group(1)) == int(report["version"]), metric
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
