"""Admin file operations stay inside the trainer's data root.

ExportHf, SaveCheckpoint and LoadWeights take a path from the network. Each is resolved the way the
filesystem will resolve it (relative paths against `data_root`, then `..` and every symlink
followed, with os.path.realpath) and refused with PERMISSION_DENIED unless the result lies inside
`data_root` (default: the trainer's working directory at start) or the configured
`checkpoint_dir`. A symlink planted inside the root that points outside is refused the same way.
A path swapped for a symlink between this check and the write is not covered: keep the root
writable only by the trainer.
"""

from __future__ import annotations

import os


class PathRefused(ValueError):
    """A path outside the allowed roots; `code` is the gRPC status name."""

    code = "PERMISSION_DENIED"


class DataRoots:
    def __init__(self, data_root: str = "", checkpoint_dir: str = ""):
        self.data_root = os.path.realpath(data_root or os.getcwd())
        self.roots = [self.data_root] + ([os.path.realpath(checkpoint_dir)] if checkpoint_dir else [])

    def resolve(self, field: str, path: str) -> str:
        """The real path `path` names, or PathRefused naming the root."""
        if not path:
            raise ValueError(f"{field} is empty")
        if "\x00" in path:
            raise ValueError(f"{field} contains a NUL byte")
        full = os.path.realpath(os.path.join(self.data_root, path))
        for root in self.roots:
            if full == root or full.startswith(root.rstrip(os.sep) + os.sep):
                return full
        where = " or ".join(self.roots)
        raise PathRefused(
            f"{field}={path!r} resolves to {full}, outside the trainer's data_root {where}; use a path "
            f"under it (relative paths are taken from it), or start the trainer with --data-root"
        )
