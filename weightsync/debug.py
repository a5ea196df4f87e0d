"""The process's debug and tuning switches, set once at start-up from the config's `debug` section.

The services resolve them with every other setting (flags > env WS_TRAINER_* / WS_ROLLOUT_* > file >
defaults; weightsync/config_common.py `DebugConfig`) and `configure` this module before anything
runs (weightsync/service_cli.py; the in-process apps in trainer_svc/app.py, rollout_svc/app.py).
Modules deep in the bus that need a switch read `switches()` when they use it, never the
environment. A process that runs no service (a `Publisher` in a training loop, a test, a
benchmark) calls `configure(Switches(...))` itself; without it every switch is off (the defaults).
docs/operations.md ("Debug switches") lists them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Switches:
    #: block-FP8 kernels on sm_89+: round with the GPU's conversion instructions (False: the bit arithmetic)
    fp8_gpu_convert: bool = True
    #: a path: the trainer writes each sync's host-time profile there (weightsync/obs/sync_profile.py)
    profile_syncs: str = ""
    #: the libnccl to load before the nvidia.nccl wheel's and the system's (weightsync/bus/nccl/libnccl.py)
    nccl_library: str = ""
    #: "module:attr" of a stand-in for the NCCL bus (tests only: tests.support.gloo_nccl:GlooNcclBus)
    nccl_bus: str = ""
    #: SGLang at tp_size > 1: each TP rank opens the bucket on its own GPU and reads its shards (False: SGLang's worker
    #: moves the whole bucket onto every rank's GPU first, the hand-over before the shard tables)
    sglang_peer_reads: bool = True
    #: SGLang: rollout-svc writes NCCL/TCP buckets into the parameters SGLang's worker exported (False: every bucket
    #: through SGLang's worker, one call each)
    sglang_rollout_writes: bool = True


_current = Switches()


def configure(switches: Switches) -> None:
    """Set the process's switches (once, at start-up, before any sync)."""
    global _current
    _current = switches


def switches() -> Switches:
    return _current
