"""GPU runs as named recipes: bench/recipes/<name>.sh, each bounded to one 10-minute device call.

    python -m bench recipe list
    OUT=/tmp/out python -m bench recipe ipc-7b     # = OUT=/tmp/out bash bench/recipes/ipc-7b.sh

A recipe's second line (a comment) says what it runs and on what; lib.sh holds what they share.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def recipes() -> dict[str, str]:
    """name -> its one-line description."""
    out = {}
    for path in sorted(HERE.glob("*.sh")):
        if path.name == "lib.sh":
            continue
        lines = path.read_text().splitlines()
        about = lines[1].lstrip("# ").strip() if len(lines) > 1 and lines[1].startswith("#") else ""
        out[path.stem] = about
    return out


def main(argv: list[str]) -> int:
    known = recipes()
    if not argv or argv[0] == "list":
        width = max(map(len, known))
        for name, about in known.items():
            print(f"{name:<{width}}  {about}")
        return 0
    name = argv[0]
    if name not in known:
        print(f"bench: no recipe named {name!r}: one of {', '.join(known)}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execvp("bash", ["bash", str(HERE / f"{name}.sh"), *argv[1:]])
    return 0  # not reached: exec replaced this process
