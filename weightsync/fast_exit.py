"""End a service process without the interpreter's teardown once it has stopped cleanly.

A service imports torch, transformers, grpc and (on a GPU host) CUDA: after its graceful stop, the
interpreter's own teardown (finalizing thousands of modules, freeing their objects one by one) took
longer than the stop itself, seconds on a busy 2-core host, paid by every restart, rolling update and
test. Nothing in that teardown is ours to wait for: the app's stop() already closed the servers and
streams, and every atexit handler (logging, the tracing exporter, multiprocessing's children) still
runs, because the handler that ends the process is registered first and so runs last.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable

#: the code the process ends with; 1 until main returns (an uncaught exception ends it with 1)
_code = [1]


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush there
            pass
    os._exit(_code[0])


def arm() -> None:
    """Register the final exit; call it before importing anything that registers atexit handlers."""
    atexit.register(_exit_now)


def run(main: Callable[[], int | None]) -> int:
    """main's exit code (a SystemExit's too, as Python would report it), also kept for the final exit."""
    try:
        rc = main()
    except SystemExit as exc:
        rc = exc.code
    if isinstance(rc, str):  # sys.exit("message"): printed, exit code 1, as the interpreter does
        print(rc, file=sys.stderr)
    _code[0] = rc if isinstance(rc, int) else (0 if rc is None else 1)
    return _code[0]


def run_cli(module: str) -> int:
    """A service's entry (`python -m` and its console script): arm the final exit, then import `module` (its
    imports register their atexit handlers after ours, so ours runs last) and run its `main`."""
    import importlib

    arm()
    return run(importlib.import_module(module).main)
