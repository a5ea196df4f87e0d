"""The services' console scripts end through weightsync.fast_exit, as `python -m` does.

pip's wrapper for a [project.scripts] entry runs `sys.exit(<module>.<function>())`; the test runs the
entry declared in pyproject.toml the same way. An object in the wrapper's globals writes a file when the
interpreter tears its modules down, so the file says whether the teardown ran (it cost a stopped
service 3.5-9 s on a loaded 2-core host). The old entry (the cli's main) is the control: there it runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# tomllib is 3.11+ and the package supports 3.10: the section's `name = "module:function"` lines, read as such
_SECTION = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.]+:\w+)"$', _SECTION, re.M))

_WRAPPER = """
import sys
class Teardown:
    def __del__(self, _open=open):  # builtins are gone by then: bound now
        _open({marker!r}, "w").write("teardown ran")
sentinel = Teardown()
from {module} import {function}
sys.argv[0] = {name!r}
sys.exit({function}())
"""


def _run_entry(entry: str, name: str, args: list[str], marker: Path) -> subprocess.CompletedProcess:
    module, function = entry.split(":")
    code = _WRAPPER.format(marker=str(marker), module=module, function=function, name=name)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["trainer-svc", "rollout-svc"])
def test_console_script_exits_with_mains_code_and_skips_the_teardown(name, tmp_path):
    ok = _run_entry(SCRIPTS[name], name, ["serve", "--help"], tmp_path / "help")
    assert ok.returncode == 0, ok.stderr
    assert f"usage: {name} serve" in ok.stdout
    assert not (tmp_path / "help").exists(), f"{name} ({SCRIPTS[name]}) ran the interpreter's teardown"
    bad = _run_entry(SCRIPTS[name], name, ["serve", "--no-such-flag"], tmp_path / "bad")
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr, (bad.returncode, bad.stderr)
    assert not (tmp_path / "bad").exists()


def test_the_marker_sees_a_teardown_where_one_runs(tmp_path):
    # the control: the cli's main without fast_exit, so a missing marker above means fast_exit ended it
    res = _run_entry("trainer_svc.cli:main", "trainer-svc", ["serve", "--help"], tmp_path / "m")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "m").read_text() == "teardown ran"
