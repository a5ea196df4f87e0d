"""The benchmark harness: `python -m bench list`, the lazy registry (every entry imports without CUDA, a missing
module says which file it wants), the named recipes, and the one result schema its writer produces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import registry
from bench.common import results

ROOT = Path(__file__).resolve().parents[3]
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )


def test_list_names_every_bench_on_one_line_without_importing_torch():
    p = _bench("list")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(registry.BENCHES)
    assert {"services", "bus", "fp8_slots", "delta", "fixed_cost", "sglang_live", "control_plane"} <= set(
        registry.BENCHES
    )
    probe = (
        "import sys, bench.__main__, bench.registry; print(sorted({'torch', 'grpc', 'megatron'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_registered_module_imports_without_initializing_cuda():
    present = [
        n for n, e in registry.BENCHES.items() if (ROOT / (e.target.split(":")[0].replace(".", "/") + ".py")).exists()
    ]
    assert set(registry.BENCHES) - set(present) <= {"control_plane"}  # bench/control_plane.py lands on its own branch
    probe = (
        "import sys, torch\n"
        "from bench import registry\n"
        f"for name in {present!r}:\n"
        "    assert callable(registry.resolve(name)), name\n"
        "print('cuda initialized:', torch.cuda.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("cuda initialized: False"), out.stdout


def test_a_missing_module_or_name_is_a_clear_error_not_a_crash(monkeypatch):
    monkeypatch.setitem(registry.BENCHES, "ghost", registry.Entry("bench.no_such_bench:main", "not there"))
    with pytest.raises(registry.UnknownBench, match="bench/no_such_bench.py is not in this checkout"):
        registry.resolve("ghost")
    with pytest.raises(registry.UnknownBench, match="python -m bench list"):
        registry.resolve("no-such-name")
    p = _bench("no-such-name")
    assert p.returncode == 2 and "no bench named 'no-such-name'" in p.stderr


def test_run_passes_argv_to_main_and_sys_argv_to_a_main_without_parameters(tmp_path, monkeypatch):
    (tmp_path / "fake_benches.py").write_text(
        "import sys\nSEEN = []\n"
        "def main(argv):\n    SEEN.append(('argv', argv))\n    return 3\n"
        "def legacy():\n    SEEN.append(('sys.argv', sys.argv[1:]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.BENCHES, "new", registry.Entry("fake_benches:main", ""))
    monkeypatch.setitem(registry.BENCHES, "old", registry.Entry("fake_benches:legacy", ""))
    monkeypatch.setattr(results, "_command", None)
    assert registry.run("new", ["--reps", "2"]) == 3
    assert results.command_line() == "python -m bench new --reps 2"
    assert registry.run("old", ["--x"]) == 0
    import fake_benches

    assert fake_benches.SEEN == [("argv", ["--reps", "2"]), ("sys.argv", ["--x"])]


def test_the_writer_names_the_file_and_fills_the_schema(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "_command", "python -m bench demo --reps 1")
    rows = [{"model": "tiny", "sync_s": 0.5, "copy_s": 0.25}]
    base = {"what": "a copy of the same bytes", "rows_key": "copy_s"}
    path = results.write_result("demo", rows, baseline=base, out=tmp_path, device="cpu", reps=1)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert path == tmp_path / f"demo_cpu_{day}.json"
    doc = json.loads(path.read_text())
    results.validate(doc)
    assert doc["bench"] == "demo" and doc["command"] == "python -m bench demo --reps 1" and doc["rows"] == rows
    assert doc["baseline"] == base and doc["reps"] == 1 and doc["date"].startswith(day) and doc["date"].endswith("Z")
    assert doc["device"] == f"cpu ({os.cpu_count()} cores)" and doc["torch"] and doc["git"]
    again = results.write_result("demo", rows, out=tmp_path, device="cpu")  # same bench, device and day
    assert again == tmp_path / f"demo_cpu_{day}-2.json" and path.exists()
    monkeypatch.setenv(results.DIR_ENV, str(tmp_path / "recipe_step"))
    assert results.write_result("demo", rows, device="cpu").parent == tmp_path / "recipe_step"


def test_the_writer_refuses_what_the_schema_does_not_allow(tmp_path):
    with pytest.raises(ValueError, match="rows_key 'copy_s' but no row carries it"):
        results.write_result("demo", [{"sync_s": 1.0}], {"what": "x", "rows_key": "copy_s"}, out=tmp_path, device="cpu")
    with pytest.raises(ValueError, match=r"extra keys \['git'\] would overwrite"):
        results.write_result("demo", [], out=tmp_path, device="cpu", git="abc")
    with pytest.raises(ValueError, match="lacks required key 'baseline'"):
        results.validate({k: "" for k in ("bench", "command", "git", "device", "torch", "date")} | {"rows": []})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "label, tag",
    [
        ("cpu (2 cores)", "cpu"),
        ("NVIDIA H200", "h200"),
        ("2x NVIDIA H200", "2xh200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
    ],
)
def test_device_tags(label, tag):
    assert results.device_tag(label) == tag


def test_recipes_are_listed_and_parse():
    p = _bench("recipe", "list")
    assert p.returncode == 0, p.stderr
    names = [line.split()[0] for line in p.stdout.splitlines()]
    scripts = sorted(f.stem for f in (ROOT / "bench" / "recipes").glob("*.sh") if f.name != "lib.sh")
    assert names == scripts and {"ipc-7b", "nccl-1to1", "sglang-live"} <= set(names)
    for name in names:
        script = ROOT / "bench" / "recipes" / f"{name}.sh"
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0, name
        text = script.read_text()
        assert "lib.sh" in text or "sglang_live.sh" in text, f"{name} neither sources lib.sh nor delegates"
    assert _bench("recipe", "no-such").returncode == 2
