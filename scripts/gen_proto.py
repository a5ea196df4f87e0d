"""Regenerate the Python stubs in weightsync/v1 from proto/weightsync/v1/*.proto.

The stubs are committed; tests/unit/test_proto_stubs.py regenerates them into a temporary
directory and fails if they differ, so run this after every .proto change:

    python scripts/gen_proto.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "weightsync" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc  # lazy: only needed by developers and the drift test

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}: {' '.join(args)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    ns = parser.parse_args()
    generate(ns.out)
    print(f"generated stubs for {len(proto_files())} proto files under {ns.out / 'weightsync' / 'v1'}", file=sys.stderr)


if __name__ == "__main__":
    main()
