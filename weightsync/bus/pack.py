"""Copy tensors into a flat bucket buffer and view them back out, on any device."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from weightsync.bus.plan import BucketPlan


def alloc_buffer(nbytes: int, device: torch.device | str = "cpu", pin: bool = False) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if pin and buf.device.type == "cpu" and torch.cuda.is_available():
        buf = buf.pin_memory()
    return buf


def pack_bucket(plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]], buf: torch.Tensor) -> torch.Tensor:
    """Copy `tensors` (in plan order) into `buf`; returns the used prefix of `buf`.

    The exporter and the plan must agree tensor by tensor; a disagreement means the manifest
    already sent would lie about the bytes, so it is an error, not something to reorder.

    The alignment gaps between tensors are zeroed: they travel and are checksummed with the
    bucket, so two packs of the same tensors must be the same bytes whatever `buf` held before
    (a delta sync diffs the stream against an earlier one; and a reused or freshly allocated
    buffer holds whatever memory it was).
    """
    if buf.numel() < plan.nbytes:
        raise ValueError(f"bucket {plan.index} needs {plan.nbytes} bytes, buffer has {buf.numel()}")
    it = iter(tensors)
    end = 0  # where the previous tensor's bytes end
    for slot in plan.slots:
        if slot.offset > end:
            buf[end : slot.offset].zero_()
        end = slot.offset + slot.meta.nbytes
        try:
            name, t = next(it)
        except StopIteration:
            raise ValueError(f"bucket {plan.index}: exporter ended before tensor {slot.meta.name}") from None
        m = slot.meta
        if name != m.name or tuple(t.shape) != m.shape or t.dtype != m.dtype:
            raise ValueError(
                f"bucket {plan.index}: exporter yielded {name} {tuple(t.shape)} {t.dtype}, "
                f"plan expects {m.name} {m.shape} {m.dtype}"
            )
        dst = buf[slot.offset : slot.offset + m.nbytes]
        dst.view(m.dtype).view(m.shape).copy_(t, non_blocking=True)
    return buf[: plan.nbytes]


def unpack_bucket(plan: BucketPlan, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, view into buf). Views alias the buffer: copy them before reusing it."""
    if buf.numel() < plan.nbytes:
        raise ValueError(f"bucket {plan.index}: received {buf.numel()} bytes, manifest says {plan.nbytes}")
    for slot in plan.slots:
        m = slot.meta
        yield m.name, buf[slot.offset : slot.offset + m.nbytes].view(m.dtype).view(m.shape)
