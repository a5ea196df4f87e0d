"""A block-FP8 sync that the trainer writes into an engine that dequantizes (colocated CUDA IPC, trainer_writes).

weightsync/bus/ipc/trainer_writes.py writes a bf16 sync's buckets into the engine's parameters; the bus
imports no format, so what a block-FP8 manifest needs is here (`Fp8Writes`, which the publisher hands
the sync's session). The rollout's table covers the tensors as its engine holds them (each FP8 weight
its parameter: bf16 or float32, the weight's shape; no scale: rollout_svc/quantized.py write_metas),
and the stream (`Fp8TrainerWriteSender`) writes:

- from the actor's own buckets (megatron's flat export, `write_fp8_from`): every FP8 weight straight
  from its parameter, quantized and dequantized in one launch (write_slots.py), and every other tensor
  by the fused copy-and-checksum launch of the bf16 path (verified_copy.copy_all_into, its FP8 and
  scale slots left out); a bucket's checksum is the sum of both parts' word sums, which are the words
  of the FP8 bucket any other path sends (its gaps read from the bucket, as always). The actor does
  not quantize into its buckets first: that pass is what this removes (weightsync/publisher/stream_phase.py);
- from buckets that hold the FP8 bytes (the packed export, or an actor that quantized anyway): each
  bucket dequantized into the parameters by the rollout's own fused launch (dequantize_slots.py),
  summing what it reads.

Either way the version's checksum is the one an FP8 rollout_reads or TCP sync of the same weights
gives, and the engine's parameters the same values. A non-finite weight fails the sync naming it
(after the write: the rollout, paused and STALE since its prepare, never serves that version).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from weightsync.bus.ipc.trainer_writes import DestinationError, Destinations, TrainerWriteSender, slot_metas
from weightsync.bus.plan import BucketPlan, Manifest
from weightsync.formats.fp8.blocks import is_block_scale, weight_name
from weightsync.formats.fp8.quantize_slots import SlotWeight
from weightsync.formats.fp8.receive import logical_metas
from weightsync.formats.fp8.spec import FP8_DTYPE, check_supported
from weightsync.formats.fp8.write_slots import OUT_DTYPES


class Fp8Writes:
    """trainer_writes.QuantizedWrites for block FP8."""

    def destination_dtypes(self, manifest: Manifest) -> list[tuple[torch.dtype, ...]]:
        """Per slot: an FP8 weight's destination is bf16 or float32 (what the fused kernels write), its
        scale has none, every other tensor its own dtype. ValueError naming the setting or the tensor
        for a manifest that is not complete block-FP8 pairs."""
        check_supported(manifest.quantization)
        logical_metas(manifest.metas())
        metas = slot_metas(manifest)
        fp8 = {m.name for m in metas if m.dtype == FP8_DTYPE}
        return [OUT_DTYPES if m.dtype == FP8_DTYPE else () if is_block_scale(m, fp8) else (m.dtype,) for m in metas]

    def sender(self, dests: Destinations, rid: str, manifest: Manifest) -> Fp8TrainerWriteSender:
        return Fp8TrainerWriteSender(dests, rid, manifest)


class Fp8TrainerWriteSender(TrainerWriteSender):
    """The stream of a block-FP8 trainer-writes sync (the module docstring says how it writes)."""

    def __init__(self, dests: Destinations, rid: str, manifest: Manifest):
        super().__init__(dests, rid)
        self.manifest = manifest
        state = dests.writer_state
        if "dequant" not in state:
            from weightsync.formats.fp8.dequantize_slots import FusedDequant

            state["dequant"] = FusedDequant()
        self._dequant = state["dequant"]
        self._held = self._dequant.begin(manifest)  # scales whose weight comes in a later bucket
        self._fused = None

    def write_fp8_from(self, weights: Sequence[SlotWeight]) -> bool:
        """The actor's FP8 weights (where their rows are in its parameters, where their slots lie in
        its buckets): `send_held` writes them from there. False, taking nothing, when they cannot go
        that way (write_slots.plan); the actor then quantizes into its buckets and those are sent."""
        from weightsync.formats.fp8 import write_slots

        key = ("fused", tuple((w.name, w.bucket, w.q_offset, *(s.data_ptr() for _, s in w.pieces)) for w in weights))
        state = self.dests.writer_state
        if key not in state:
            # (bucket position, e4m3 offset, scale bucket, scale offset, destination) of each FP8 weight
            where = {}
            for k, plan in enumerate(self.manifest.buckets):
                for j, slot in enumerate(plan.slots):
                    if slot.meta.dtype == FP8_DTYPE:
                        where[slot.meta.name] = [k, slot.offset, None, None, self.dests.buckets[k][j]]
            for k, plan in enumerate(self.manifest.buckets):
                for slot in plan.slots:
                    if is_block_scale(slot.meta, where.keys()):
                        where[weight_name(slot.meta.name)][2:4] = [k, slot.offset]
            # every FP8 weight of the manifest, at its slots: the sums then cover exactly those slots' words
            fused = None
            if len(weights) == len(where) and all(
                w.name in where and where[w.name][:4] == [w.bucket, w.q_offset, w.scale_bucket, w.s_offset]
                for w in weights
            ):
                fused = write_slots.plan(weights, [where[w.name][4] for w in weights], len(self.manifest.buckets))
            for k in [k for k in state if isinstance(k, tuple) and k[0] == "fused"]:
                del state[k]  # another set of sources (a re-planned actor): one kept
            state[key] = fused
        self._fused = state[key]
        return self._fused is not None

    def _write(self, plan: BucketPlan, buf: torch.Tensor):
        pending = self._dequant.copy(plan, buf, self.dests.buckets[plan.index], self._held, wait=False)
        if pending is None:
            raise DestinationError(f"bucket {plan.index}: the engine's parameters cannot take it dequantized")
        return pending

    def send_held(self, plans, bufs) -> bool:
        """The actor's own buckets with its FP8 weights given (`write_fp8_from`): the FP8 weights in one
        launch from their parameters, the other tensors in the copy launch; False (each bucket is
        then sent, dequantized from its FP8 bytes) without them."""
        if self._fused is None:
            return False
        from weightsync.bus.copy.verified_copy import copy_all_into

        t0 = time.perf_counter()
        copies = self.dests.writer_state.get("copies")
        if copies is None:  # the destinations with the FP8 weights left out (the fused launch writes them)
            fp8 = {m.name for m in slot_metas(self.manifest) if m.dtype == FP8_DTYPE}
            copies = self.dests.writer_state["copies"] = [
                [None if s.meta.name in fp8 else v for s, v in zip(plan.slots, views)]
                for plan, views in zip(self.manifest.buckets, self.dests.buckets)
            ]
        fp8_sums = self._fused.run()
        index = {p.index: k for k, p in enumerate(self.manifest.buckets)}
        pending = copy_all_into(plans, bufs, [copies[index[p.index]] for p in plans], prepared=self.dests.prepared)
        if pending is None:
            raise DestinationError("the engine's parameters cannot take the buckets' unquantized tensors as words")
        for p, plan in zip(pending, plans):
            # the FP8 and scale slots' words, summed as written; in place: p.sums is a row of the launch's
            # sums, which flush reads all at once (PendingChecksum.rows)
            p.sums += fp8_sums[index[plan.index]]
        self._pending = pending
        self.phase_seconds["queue"] = time.perf_counter() - t0
        return True

    def _check_written(self) -> None:
        if self._fused is not None and not self._fused.finite():
            err = self._fused.first_non_finite()
            raise ValueError(f"the trainer's weights are not finite: {err}" if err else "an FP8 block is not finite")
