"""A bucket handed to SGLang's TP ranks on other GPUs without SGLang moving it there whole (issue 47).

SGLang's worker moves every tensor it is given onto its own GPU before our loader runs
(`_unwrap_tensor(...).to(device)`, 0.5.10 ModelRunner and 0.5.23 WeightUpdater). A bucket on GPU 0 handed to
the TP rank on GPU 1 is therefore copied there whole, and that rank reads the whole bucket over the link
however little of it is its shard. So for `tp_size` > 1 each rank gets its own pickle of the same CUDA IPC
handle, labelled with that rank's GPU (SGLang's per-rank `LocalSerializedTensor`, which its safe unpickler
admits): the worker opens the handle on its own device (CUDA maps it there with peer access enabled), the
`.to(device)` is a no-op, and our loader's copy reads only the rank's shards across the link.

Run on 2×H200 (docs/sglang.md); `SglangOptions.peer_reads=False` (the debug switch `sglang_peer_reads`) hands
every rank the same pickle as before.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class _Rebuild:
    """Pickles as `fn(*args)` (a CUDA tensor's rebuild with another device in its arguments)."""

    def __init__(self, fn: Any, args: tuple):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


#: argument index of the device in torch's `rebuild_cuda_tensor` (SGLang's patch writes the GPU's UUID there)
DEVICE_ARG = 6


@functools.lru_cache(maxsize=64)
def gpu_uuid(index: int) -> str:
    """The form SGLang's patched rebuild matches a GPU by (sglang.srt.utils.patch_torch)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def rank_rebuilds(src: Any, gpus: list[int]) -> list[Any]:
    """`src` (an `_IpcTensor` or a CUDA tensor of this process) once per rank, each opening on `gpus[rank]`."""
    from rollout_svc.engine.sglang_weights import _IpcTensor

    if isinstance(src, _IpcTensor):
        return [_IpcTensor(src.handle, src.nbytes, device=gpu_uuid(g)) for g in gpus]
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(src)  # SGLang's patched reducer (sglang_weights._patch_reductions)
    out = []
    for g in gpus:
        per = list(args)
        per[DEVICE_ARG] = gpu_uuid(g)
        out.append(_Rebuild(fn, tuple(per)))
    return out


def per_rank(src: Any, gpus: list[int]) -> Any:
    """SGLang's `LocalSerializedTensor` of `src` for TP ranks on `gpus` (`_unwrap_tensor` opens rank r's)."""
    from sglang.srt.utils import MultiprocessingSerializer

    try:  # 0.5.2x keeps it with the weight updater (its safe unpickler admits both paths)
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    except ImportError:
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor

    return LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(r) for r in rank_rebuilds(src, gpus)])
