"""`python -m rollout_svc` and the `rollout-svc` console script (pyproject's [project.scripts]): both end through
weightsync.fast_exit, so a cleanly stopped service skips the interpreter's teardown however it was started."""

import sys

from weightsync import fast_exit


def main() -> int:
    return fast_exit.run_cli("rollout_svc.cli")


if __name__ == "__main__":
    sys.exit(main())
