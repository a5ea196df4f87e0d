"""The committed stubs must be exactly what the pinned grpcio-tools generates from proto/."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_proto_files(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    fresh = tmp_path / "weightsync" / "v1"
    committed = ROOT / "weightsync" / "v1"
    names = sorted(p.name for p in fresh.iterdir() if p.suffix in (".py", ".pyi"))
    assert names, "protoc generated nothing"
    drift = [n for n in names if not filecmp.cmp(fresh / n, committed / n, shallow=False)]
    assert not drift, f"stubs drifted from proto/: {drift}; run `python scripts/gen_proto.py` and commit"
    assert {p.name for p in committed.glob("*_pb2*.py*")} == set(names)
