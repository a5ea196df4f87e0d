"""`python -m rollout_svc` and the `rollout-svc` console script (pyproject's [project.scripts]): both end through
weightsync.fast_exit, so a cleanly stopped service skips the interpreter's teardown however it was started."""

import sys

from weightsync import fast_exit


def main() -> int:
    fast_exit.arm()  # before the service's imports register their atexit handlers: it runs last
    from rollout_svc.cli import main as cli_main

    return fast_exit.run(cli_main)


if __name__ == "__main__":
    sys.exit(main())
