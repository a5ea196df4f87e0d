"""tests/conftest.py under pytest-xdist: a `serial` test runs while no other test runs on any worker.

An inner pytest on two workers runs the suite's conftest over a serial test and a few plain ones; each
appends its worker and start/end instants (CLOCK_MONOTONIC, one clock for every process) to a file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

_RECORD = """
import os, time
import pytest

def _span(path, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(path, "a") as f:
        f.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{NAME}} {{start}} {{time.monotonic()}}\\n")
"""


def test_a_serial_test_overlaps_no_other_test_on_any_worker(tmp_path):
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    serial: alone\n")
    spans = tmp_path / "spans.txt"
    (tmp_path / "test_a_serial.py").write_text(
        _RECORD.replace("{{NAME}}", "serial").replace("{{", "{").replace("}}", "}")
        + f"\n@pytest.mark.serial\ndef test_timed():\n    _span({str(spans)!r}, 0.6)\n"
    )
    (tmp_path / "test_b_plain.py").write_text(
        _RECORD.replace("{{NAME}}", "plain").replace("{{", "{").replace("}}", "}")
        + "".join(f"\ndef test_plain_{i}():\n    _span({str(spans)!r}, 0.15)\n" for i in range(8))
    )
    # xdist alone: the environment's other plugins (hypothesis, ...) would triple the workers' start-up
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider", "-n", "2", "--dist", "load"]
    res = subprocess.run(
        [*cmd, str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line.split() for line in spans.read_text().splitlines()]
    assert len(rows) == 9 and {r[0] for r in rows} == {"gw0", "gw1"}, rows
    (_, _, s0, s1), plain = next(r for r in rows if r[1] == "serial"), [r for r in rows if r[1] == "plain"]
    overlapping = [r for r in plain if float(r[2]) < float(s1) and float(s0) < float(r[3])]
    assert not overlapping, f"ran during the serial test ({s0}..{s1}): {overlapping}"
