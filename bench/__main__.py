"""`python -m bench list`, `python -m bench <name> [args]`, `python -m bench recipe <name>` (docs/BENCHMARKS.md)."""

from __future__ import annotations

import sys

from bench import recipes
from bench.registry import BENCHES, UnknownBench, run

USAGE = "usage: python -m bench list | <name> [args] | recipe list | recipe <name>"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "list":
        width = max(map(len, BENCHES))
        for key, e in BENCHES.items():
            print(f"{key:<{width}}  {e.about} [{e.where}]")
        return 0
    if name == "recipe":
        return recipes.main(rest)
    try:
        return run(name, rest)
    except UnknownBench as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
