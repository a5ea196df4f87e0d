"""SGLang's own options (`inference.sglang` / `--sglang-arg KEY=VALUE`), checked against the installed
SGLang before its Engine is built.

Any field of SGLang's ServerArgs may be set, except the few this adapter derives from the rollout's
own settings (so one setting never has two sources) and the ones it needs fixed (token ids in and
out: no tokenizer in the engine; cumulative streamed outputs).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

#: (ServerArgs field this adapter sets itself, the rollout setting to use instead; "" = fixed)
OWNED = dict(
    (
        ("model_path", "model"),
        ("tp_size", "tp"),
        ("dtype", "dtype"),
        ("base_gpu_id", "device"),
        ("skip_tokenizer_init", ""),
        # streamed items must hold every token so far (sglang_stream.py)
        ("incremental_streaming_output", ""),
    )
)


def server_arg_names() -> tuple[str, set[str]]:
    """(installed SGLang version, names of its ServerArgs fields)."""
    from importlib.metadata import PackageNotFoundError, version

    from sglang.srt.server_args import ServerArgs

    try:
        installed = version("sglang")
    except PackageNotFoundError:  # importable but not pip-installed (a source checkout)
        installed = "(unknown version)"
    return installed, {f.name for f in dataclasses.fields(ServerArgs)}


def check_options(options: dict[str, Any], known: set[str], version: str) -> None:
    """Refuse an option SGLang does not have, or one this adapter owns; the message names the fix."""
    for key in sorted(options):
        if key in OWNED:
            instead = OWNED[key]
            fix = f"set the rollout's `{instead}` instead" if instead else "the adapter needs it as it is"
            raise ValueError(f"sglang option {key!r} is set by rollout-svc itself: {fix}")
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ValueError(f"sglang option {key!r} is not a field of SGLang {version}'s ServerArgs{hint}")
