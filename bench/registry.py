"""Every bench by its short name: `python -m bench <name> [args]` runs `module:main(argv)`.

Entries are strings, imported only when run, so listing them imports no torch, CUDA or megatron.
"""

from __future__ import annotations

import importlib
import inspect
import shlex
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    target: str  # "module:function"
    about: str  # one line for `python -m bench list`
    where: str = "cpu"  # what it needs: cpu, 1 gpu, 2 gpus, a rollout, torchrun ...


BENCHES: dict[str, Entry] = {
    "services": Entry(
        "bench.bench_services:main", "a sync through the real services vs a D2D copy / raw broadcast", "1-2 gpus"
    ),
    "bus": Entry("bench.bench_sync:main", "the bus alone, NCCL 1->1 and CUDA IPC, vs a raw broadcast / copy", "2 gpus"),
    "verified_copy": Entry(
        "bench.bench_verified_copy:main", "the trainer_writes write pass (copy-and-checksum) vs copy_", "1 gpu"
    ),
    "fp8_slots": Entry("bench.bench_fp8_slots:main", "the block-FP8 flat sync's kernels vs a copy", "1 gpu"),
    "flat_pp": Entry(
        "bench.bench_flat_pp:main", "a PP/TP stage's export + pack vs its flat buckets", "torchrun, cpu or 2 gpus"
    ),
    "delta": Entry("bench.bench_delta:main", "full vs delta syncs over a paced TCP link, through the services"),
    "delta_nccl": Entry(
        "bench.bench_delta_nccl:main", "full vs delta (or auto) over NCCL, through the services", "2 gpus"
    ),
    "delta_codec": Entry(
        "bench.bench_delta_gpu_codec:main", "the delta codec: torch ops vs the fused kernels", "1 gpu"
    ),
    "delta_apply": Entry("bench.bench_delta_apply:main", "a rollout's CPU work per delta bucket: full vs sparse apply"),
    "delta_density": Entry("bench.bench_delta_density:main", "values changed per optimizer step in the RL loop"),
    "fixed_cost": Entry("bench.bench_fixed_cost:main", "plan, prepare, commit of a 339-tensor TCP sync"),
    "sync_fixed_cost": Entry(
        "bench.bench_sync_fixed_cost:main", "the fixed cost of a colocated trainer_writes sync (GPU faked)"
    ),
    "rpc_floor": Entry("bench.bench_rpc_floor:main", "the gRPC / socket round-trip floor of this host"),
    "prepare_overlap": Entry(
        "bench.bench_prepare_overlap:main", "the trainer's own prepare work overlapping the round trip"
    ),
    "multisender": Entry("bench.bench_multisender_cpu:main", "multi-sender vs the rank-0 funnel over paced links"),
    "fairness": Entry("bench.bench_fairness:main", "small requests' latency while a large one runs", "a rollout"),
    "stream": Entry("bench.bench_stream:main", "first streamed token vs the whole answer", "a rollout or cpu"),
    "builtin_concurrency": Entry(
        "bench.bench_builtin_concurrency:main", "the built-in engine under concurrent requests", "cpu or 1 gpu"
    ),
    "sglang_live": Entry("bench.sglang_live:main", "SGLang live: IPC/NCCL syncs vs its built-in update", "1-2 gpus"),
    "control_plane": Entry("bench.control_plane:main", "the control plane's round trips and fan-out"),
    "trace_overhead": Entry("bench.trace_overhead:main", "a sync with tracing off / on vs no tracing hooks"),
    "cost_model": Entry("bench.cost_model:main", "(tool) the fleet cost model: predictions, tables, calibration"),
    "profile_summary": Entry(
        "bench.profile_summary:main", "(tool) the top of a the `profile_syncs` debug switch profile"
    ),
}


class UnknownBench(LookupError):
    pass


def resolve(name: str):
    """The entry's function, imported now. A module that is not there names the bench and the file it wants."""
    if name not in BENCHES:
        raise UnknownBench(f"no bench named {name!r}: `python -m bench list` shows them")
    module, _, func = BENCHES[name].target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        path = module.replace(".", "/") + ".py"
        raise UnknownBench(
            f"bench {name!r} is registered as {module}:{func} but {path} is not in this checkout"
        ) from None
    return getattr(mod, func)


def run(name: str, argv: list[str]) -> int:
    """Runs one bench with `argv`; its exit status (0 when main returns None)."""
    from bench.common.results import set_command

    fn = resolve(name)
    set_command("python -m bench " + shlex.join([name, *argv]))
    if inspect.signature(fn).parameters:
        rc = fn(argv)
    else:  # a main() that parses sys.argv itself (bench/sglang_live.py)
        saved = sys.argv
        sys.argv = [f"bench {name}", *argv]
        try:
            rc = fn()
        finally:
            sys.argv = saved
    return int(rc or 0)
