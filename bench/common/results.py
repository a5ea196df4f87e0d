"""The one result schema of every bench (docs/BENCHMARKS.md, "Result files") and its one file naming:
`bench/results/<bench>_<device>_<date>.json`.

Top-level keys, all required: bench, command, git, device, torch, date, rows, baseline (what the rows are
compared against in the same run, or None). Extra top-level keys are allowed (the run's settings, a model's
shape, ...). Seconds go in keys ending `_s`, bytes in keys ending `_bytes`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
REQUIRED = {
    "bench": str,
    "command": str,
    "git": str,
    "device": str,
    "torch": str,
    "date": str,
    "rows": list,
    "baseline": (dict, type(None)),
}
# Where a run's file goes when the bench is given no --out: recipes point it at $OUT.
DIR_ENV = "BENCH_RESULTS_DIR"
_command: str | None = None


def set_command(command: str) -> None:
    """The command line to record (the harness sets `python -m bench <name> ...`)."""
    global _command
    _command = command


def command_line() -> str:
    if _command is not None:
        return _command
    return "python " + shlex.join(sys.argv)


def git_rev() -> str:
    """`git rev-parse --short HEAD` of this checkout, "-dirty" when the tree has changes; "unknown" outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("-dirty" if dirty else "")


def device_label(device: str | None = None) -> str:
    """ "cpu (N cores)" or the GPU's name (with the count when more than one is visible)."""
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            name = torch.cuda.get_device_name(0)
            return name if n == 1 else f"{n}x {name}"
    return f"cpu ({os.cpu_count()} cores)"


def device_tag(label: str) -> str:
    """The file name's device: cpu, h100, h200, 2xh200 ... from `device_label`'s text."""
    if label.startswith("cpu"):
        return "cpu"
    count, _, name = label.partition("x ") if re.match(r"^\d+x ", label) else ("1", "", label)
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    model = (m.group(1) if m else re.sub(r"[^a-z0-9]+", "", name.lower())[:16] or "gpu").lower()
    return model if count == "1" else f"{count}x{model}"


def result_path(bench: str, tag: str, date: str, directory: Path) -> Path:
    """`<directory>/<bench>_<tag>_<date>.json`; a later run of the same day gets `-2`, `-3`, ... before `.json`."""
    path = directory / f"{bench}_{tag}_{date}.json"
    n = 2
    while path.exists():
        path = directory / f"{bench}_{tag}_{date}-{n}.json"
        n += 1
    return path


def validate(doc: dict) -> None:
    """Raises ValueError naming the first key of the schema that `doc` lacks or has of the wrong type."""
    for key, kind in REQUIRED.items():
        if key not in doc:
            raise ValueError(f"result lacks required key {key!r} (schema: bench/common/results.py)")
        if not isinstance(doc[key], kind):
            raise ValueError(f"result key {key!r} is {type(doc[key]).__name__}, expected {kind}")
    for i, row in enumerate(doc["rows"]):
        if not isinstance(row, dict):
            raise ValueError(f"rows[{i}] is {type(row).__name__}: every row is a dict of one configuration")
    key = (doc["baseline"] or {}).get("rows_key")
    if key and not any(key in row for row in doc["rows"]):
        raise ValueError(f"baseline names rows_key {key!r} but no row carries it: put the baseline next to each row")


def write_result(
    bench: str,
    rows: list[dict],
    baseline: dict | None = None,
    command: str | None = None,
    out: str | os.PathLike | None = None,
    device: str | None = None,
    **extra,
) -> Path:
    """Writes one run as the schema says and returns its path.

    `out`: a directory (the file is named there), a file path (kept as given), or None: $BENCH_RESULTS_DIR,
    else bench/results/. `device="cpu"` records the CPU for a bench that ran there on a GPU host."""
    import torch

    label = device_label(device)
    doc = {
        "bench": bench,
        "command": command or command_line(),
        "git": git_rev(),
        "device": label,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
        "baseline": baseline,
    }
    clash = set(extra) & set(doc)
    if clash:
        raise ValueError(f"extra keys {sorted(clash)} would overwrite the schema's: rename them")
    doc.update(extra)
    validate(doc)
    target = Path(out) if out else Path(os.environ.get(DIR_ENV) or RESULTS)
    if out is None or target.is_dir() or not target.suffix:
        target.mkdir(parents=True, exist_ok=True)
        target = result_path(bench, device_tag(label), doc["date"][:10], target)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {target}", file=sys.stderr)
    return target
