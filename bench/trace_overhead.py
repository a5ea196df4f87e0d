"""What the sync's tracing hooks cost: off (no OTEL_EXPORTER_OTLP_ENDPOINT, no provider), against the
same syncs with the hooks replaced by no-op stand-ins, and on (the OpenTelemetry SDK recording into
its in-memory exporter), in one run.

A TrainerApp (hf backend, tiny-qwen2) and one RolloutApp (built-in engine) in this process on
loopback, TCP bus, sync link on; each round runs one sync per configuration in turn (so drift on a
shared machine lands on all three alike; which one goes first rotates) and the trainer's SyncReport
times it. Per configuration: the median and its ratio to the baseline's, and the median of the
differences to the baseline sync of the same round (`paired_delta_median_s`). Also the hooks' own
cost per call with tracing off (`phase`, `traceparent`), timed in a loop, and the OTLP exporter
modules loaded (none: nothing took the exporter's path).

    OMP_NUM_THREADS=1 python bench/trace_overhead.py --syncs 200 \\
        --out bench/results/trace_overhead_cpu_2026-11-28.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ("baseline", "off", "on")


def _stand_ins():
    """The tracing hooks the sync path calls, as no-ops: the sync as it was before the hooks."""
    from weightsync.obs import tracing

    class _Finish:
        def finish(self, report) -> None:
            pass

    return {
        "phase": lambda name: contextlib.nullcontext(),
        "sync_span": lambda transport: contextlib.nullcontext(_Finish()),
        "planned": lambda *a: None,
        "traceparent": lambda: "",
    }, tracing


def _hook_ns() -> dict[str, float]:
    """ns per call of the hooks with tracing off."""
    from weightsync.obs import tracing

    def phase():
        with tracing.phase("stream"):
            pass

    n = 200_000
    return {
        "phase_off_ns": min(timeit.repeat(phase, number=n, repeat=3)) / n * 1e9,
        "traceparent_off_ns": min(timeit.repeat(tracing.traceparent, number=n, repeat=3)) / n * 1e9,
        "nullcontext_ns": min(timeit.repeat(lambda: contextlib.nullcontext().__enter__(), number=n, repeat=3))
        / n
        * 1e9,
    }


def run(syncs: int) -> dict:
    from opentelemetry.sdk.trace import TracerProvider  # the "on" rows need the SDK (the otel extra)
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tests.support.local_apps import local_fleet
    from weightsync.v1 import trainer_pb2

    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        os.environ.pop(var, None)
    stand_ins, tracing = _stand_ins()
    real = {name: getattr(tracing, name) for name in stand_ins}
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    seconds: dict[str, list[float]] = {c: [] for c in CONFIGS}
    spans_per_sync = 0
    with local_fleet({"r1": {}}, "bench-token") as (_, _, stub):
        for _ in range(3):  # warm: the link, the layout cache, the allocator
            assert stub.Sync(trainer_pb2.SyncRequest()).report.ok
        for i in range(syncs):
            for config in CONFIGS[i % 3 :] + CONFIGS[: i % 3]:  # each configuration first in a third of rounds
                for name, fn in (stand_ins if config == "baseline" else real).items():
                    setattr(tracing, name, fn)
                tracing.configure(provider if config == "on" else None)
                report = stub.Sync(trainer_pb2.SyncRequest()).report
                assert report.ok, report
                seconds[config].append(report.seconds)
                if config == "on":
                    spans_per_sync = len(exporter.get_finished_spans())
                    exporter.clear()
        for name, fn in real.items():
            setattr(tracing, name, fn)
        tracing.configure(None)
        size = report.bytes
    rows = []
    base = statistics.median(seconds["baseline"])
    for config in CONFIGS:
        s = sorted(seconds[config])
        rows.append(
            {
                "config": config,
                "syncs": len(s),
                "sync_s": statistics.median(s),
                "sync_p10_s": s[len(s) // 10],
                "sync_p90_s": s[(len(s) * 9) // 10],
                "baseline_sync_s": base,
                "ratio_to_baseline": statistics.median(s) / base,
                # the same round's syncs paired: drift between rounds cancels
                "paired_delta_median_s": statistics.median(a - b for a, b in zip(seconds[config], seconds["baseline"])),
                "weights_bytes": size,
            }
        )
    # the bench loads the SDK itself for the "on" rows; tracing's own OTLP path would load an exporter
    exporters = sorted(m for m in sys.modules if m.startswith("opentelemetry.exporter"))
    return {"rows": rows, "spans_per_traced_sync": spans_per_sync, "otlp_exporter_modules": exporters}


def _git() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return rev.strip() + ("-dirty" if dirty.strip() else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--syncs", type=int, default=40, help="syncs per configuration")
    ap.add_argument("--out", default="", help="result file (JSON per bench/results' schema); empty: print only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    hooks = _hook_ns()
    result = run(args.syncs)
    doc = {
        "bench": "trace_overhead",
        "command": "python bench/trace_overhead.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "git": _git(),
        "device": f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": result["rows"],
        "baseline": {
            "what": "the same syncs, interleaved, with the tracing hooks replaced by no-op stand-ins",
            "rows_key": "baseline_sync_s",
        },
        "hooks_off_ns": hooks,
        "spans_per_traced_sync": result["spans_per_traced_sync"],
        "otlp_exporter_modules": result["otlp_exporter_modules"],
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
