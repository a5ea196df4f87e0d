"""A megatron actor's syncs from flat buckets: the layout's buckets written straight from its parameters.

`FlatExport` (flat_export.py) is one plan: a layout's buckets over the model, with the parameters
that are their own HF bytes living in them. This is what decides, per sync and per rank, whether a
sync uses such a plan or the per-tensor export and pack instead, and keeps the plan across syncs:

- `whole` (rank 0, single-sender syncs: the model is one pipeline stage), `own` (every rank of a
  multi-sender stream: the buckets it owns) and `decline` (a rank that packs for its own reasons);
- at TP > 1 the decision is a collective of the stage's TP group (`tp_exchange`, tp_gather.py):
  every rank of it must reach the same verdict at the same point of a sync, or the export's
  gathers would wait for partners that went flat;
- one plan is kept, planned again for another layout digest or when a parameter's storage moved
  (a load), and a layout the plan refused is not tried again.
"""

from __future__ import annotations

import logging

import torch

from weightsync.bus.errors import TransportError

log = logging.getLogger(__name__)


class FlatBuckets:
    """The flat-bucket side of one `MegatronActor` (its parallelism, rank map, model and command channel)."""

    def __init__(self, actor):
        self.actor = actor
        #: the model laid out as the current layout's buckets, once a sync asked for it
        self._flat = None
        self._flat_refused = ""  # the layout digest FlatExport could not plan (syncs pack instead)
        self._tp = None  # at TP > 1: this rank's TP group as the flat export's exchange sees it (tp_gather.py)

    @property
    def plan(self):
        """The FlatExport kept for the last layout a sync used it for (None: none yet, or dropped)."""
        return self._flat

    def known_sums(self):
        """The kept plan's KnownSums of the buckets its last refresh wrote (flat_export.py), or None."""
        return None if self._flat is None else self._flat.known_sums()

    def drop(self) -> None:
        """Forget the plan: the next sync plans afresh (benchmarks time the first plan this way)."""
        self._flat = None

    def whole(self, manifest, quantize: bool = True) -> list[torch.Tensor] | None:
        """Rank 0: the manifest's buckets written straight from this model (flat_export.py), so a
        sync needs neither the per-tensor export nor the pack copy; the parameters that are their
        own HF bytes move into the buckets on the first call for a layout and stay there.

        At TP > 1 (PP = VPP = EP = 1, experts unsplit, unquantized) the other TP ranks take part: a
        command puts them in the exchange (`_flat_tp`, tp_gather.py), where they send rank 0 their
        shards of the sharded parameters, received into persistent buffers or straight into their
        slots; the group agrees first, so a refused plan leaves every rank to the per-tensor export.

        None (the sync exports and packs instead) unless the model is one pipeline stage (PP=EP=1, any
        TP; no bridge converter), mostly in the dtype of the unquantized slots: a parameter in another
        dtype (megatron's fp32 norms in a bf16 model) is cast into its slot at every sync and its slots
        are memory kept beside the model, which is worth it for a few norms, not for a model-sized
        second copy (the pack path casts with two buckets' memory).

        A block-FP8 layout (`manifest.quantization`): the FP8 weights are quantized into their slots
        by one launch per bucket, on a GPU with triton only (elsewhere the per-tensor export keeps
        its torch path); None also when a block is not finite, without naming it here: the packed
        export that the sync falls back to refuses the weights naming the tensor, as it always did.
        `quantize=False`: the FP8 slots are not written (a sync expected to write the weights into the
        engine from the parameters, weightsync/formats/fp8/trainer_writes.py); `quantize_deferred`
        writes them if it does not after all.
        """
        par = self.actor.par
        if not manifest.layout_digest or self.actor.converter is not None or (par.pp, par.vpp, par.ep) != (1, 1, 1):
            return None
        if self.actor.rmap.rank != 0:
            return None
        quantized = manifest.quantization is not None
        if par.tp > 1:
            if quantized or not self._tp_flat_layout():
                return None
            # the other TP ranks send their shards (or hear that rank 0 exports instead): worker_loop
            self.actor.channel.send("flat_join")
            return self.tp_exchange(manifest, part=False)
        if quantized and not self._quantizes_in_place(manifest):
            return None
        return self._flat_buckets(manifest, part=False, quantize=quantize)

    def own(self, manifest) -> list[torch.Tensor] | None:
        """Every rank of a multi-sender stream: `manifest`'s buckets (the ones this rank owns,
        `Manifest.buckets_of`) written straight from this rank's parameters as `whole` writes
        the whole model's, so the rank needs neither its export nor the pack copy.

        None (the rank exports and packs its buckets instead) unless no bridge converter, an
        unquantized layout with a layout digest, and the parameters mostly in the slots' dtype (as
        `whole`); and either

        - TP = expert-TP = 1 (pipeline stages, virtual ones too, and any EP: an EP rank writes its own
          experts, the stage's dense leader the dense tensors too). The decision is then safe per rank:
          the multi-sender export runs no collective (export.runs_no_collective), so a rank that skips
          it leaves no other rank waiting, whichever way the others went; or
        - TP > 1 at expert-TP = 1 (any EP): a collective of the TP group (tp_gather.py), which every
          rank of a stage's TP group must call at the same point of a sync with its own buckets (the
          stage's dense ones on the leader, an EP rank's experts, or none); [] on a rank without
          buckets that sent its shards. The group agrees first, so a plan refused on any rank of
          it (or `decline`) makes every rank of the group export."""
        from trainer_svc.actor.megatron.export import runs_no_collective

        if not manifest.layout_digest or self.actor.converter is not None or manifest.quantization is not None:
            return None
        if not runs_no_collective(self.actor.par):
            return self.tp_exchange(manifest, part=True) if self._tp_flat_layout() else None
        if not manifest.buckets:
            return None
        return self._flat_buckets(manifest, part=True)

    def decline(self, manifest) -> None:
        """A rank of a multi-sender stream that packs this sync for its own reasons, where
        `own` would have been a collective: its TP group hears it, and every rank of the
        group exports (a no-op where the flat path is decided per rank)."""
        from trainer_svc.actor.megatron.export import runs_no_collective

        if not manifest.layout_digest or self.actor.converter is not None or manifest.quantization is not None:
            return
        if not runs_no_collective(self.actor.par) and self._tp_flat_layout():
            self.tp_exchange(manifest, part=True, decline=True)

    def _tp_flat_layout(self) -> bool:
        """Whether the flat export can run at this TP > 1 layout: dense TP only (experts unsplit:
        expert-TP = 1, any EP), no bridge converter. From config alone: the same on every rank."""
        par = self.actor.par
        experts_split = bool(self.actor.spec.dims.num_experts) and par.expert_tp > 1
        return par.tp > 1 and not experts_split and self.actor.converter is None

    def tp_exchange(self, manifest, *, part: bool, decline: bool = False) -> list[torch.Tensor] | None:
        """At TP > 1, on every rank of a stage's TP group together (tp_gather.py): the leader plans
        its buckets (`manifest`, None on a rank with none), the group agrees, and then the leader's
        buckets are written, the other ranks sending it their shards. The leader's buckets, [] on the
        other ranks, or None on every rank of the group (each exports instead)."""
        from trainer_svc.actor.megatron import tp_gather
        from trainer_svc.actor.megatron.model import named_parameters_global

        if not self.actor.rmap.in_replica0:
            # holds no dense tensor any export gathers: its export runs no collective, and its buckets (an
            # EP rank's unsplit experts, if any) are planned as at TP = 1, on this rank's word alone
            owns = manifest is not None and bool(manifest.buckets)
            return self._flat_buckets(manifest, part=part) if owns and not decline else None
        if self._tp is None:
            self._tp = tp_gather.tp_group(
                self.actor.spec,
                self.actor.par,
                self.actor.rmap.pp_rank,
                self.actor.rmap.tp_rank,
                self.actor.export_dtype,
            )
        g = self._tp
        flat = None
        owns = manifest is not None and bool(manifest.buckets)
        ok = not decline and (owns or g.tp_rank != 0 or not g.names)
        if ok and owns:
            try:
                flat = self._plan(manifest, part=part, tp=g)
            except Exception:  # every rank of the group must still hear this one's verdict
                log.exception("flat buckets: planning layout %s failed; the TP group exports", manifest.layout_digest)
            ok = flat is not None
        if not tp_gather.agree(ok, g, self.actor.parameters()[0].device):
            return None
        try:
            if g.tp_rank != 0:
                tp_gather.send_shards(named_parameters_global(self.actor.model), g)
            return [] if flat is None else flat.refresh()
        except Exception as exc:
            # every rank of the group went flat: none may fall back to the export's gathers now (they
            # would wait for partners that are not coming), so the sync fails on this rank instead
            self._flat = None  # its buffers may hold part of an exchange
            raise TransportError(
                f"rank {self.actor.rmap.rank}: the TP group's flat-export exchange failed: {exc}"
            ) from exc

    def _flat_buckets(self, manifest, *, part: bool, quantize: bool = True) -> list[torch.Tensor] | None:
        """The buckets of `manifest` from the layout's FlatExport (`_plan`), written (None: pack instead)."""
        flat = self._plan(manifest, part=part)
        if flat is None:
            return None
        buffers = flat.refresh(quantize)
        return self._finite(flat, buffers) if quantize else buffers

    def fp8_weights(self):
        """The kept plan's FP8 weights (quantize_slots.SlotWeight: their rows in the parameters, their slots
        in the buckets): what a sync that writes into the engine dequantizes from (none without a plan)."""
        return [] if self._flat is None else self._flat.fp8_weights()

    def quantize_deferred(self) -> ValueError | None:
        """Quantize the FP8 weights into the buckets of the last `whole(quantize=False)` now (the sync did
        not write into the engine after all); the error naming the first non-finite weight, or None."""
        if self._flat is None:
            return None
        self._flat.quantize()
        return None if self._flat.finite() else self._flat.non_finite_error()

    def _plan(self, manifest, *, part: bool, tp=None):
        """The layout's FlatExport, planned once per layout digest and again when a parameter moved
        (None: pack instead). One plan is kept: a sync of another layout (the funnel after a
        multi-sender sync) plans again, moving the aliased parameters into its buckets."""
        quantized = manifest.quantization is not None
        flat = self._flat
        if flat is not None and flat.digest == manifest.layout_digest and not flat.stale():
            return flat  # the parameters are where the plan found them: same dtypes too
        params = self.actor.parameters()
        slot_dtype = torch.bfloat16 if quantized else self.actor.export_dtype  # export keeps the rest in bf16
        cast = sum(p.numel() for p in params if p.dtype != slot_dtype)
        if cast * 8 > sum(p.numel() for p in params):
            return None
        if self._flat_refused == manifest.layout_digest:
            return None
        from trainer_svc.actor.megatron.flat_export import FlatExport

        self._flat = None  # the previous layout's buckets are dropped before the new ones are built
        try:
            self._flat = FlatExport(manifest, self.actor.model, self.actor.spec, part=part, tp=tp)
        except ValueError as exc:  # not planned again for this layout: every sync would pay the attempt
            self._flat_refused = manifest.layout_digest
            log.warning("flat buckets refused for layout %s: %s; syncs pack instead", manifest.layout_digest, exc)
            return None
        return self._flat

    def _quantizes_in_place(self, manifest) -> bool:
        """Whether a block-FP8 layout can be quantized into the flat buckets on this rank's device."""
        from weightsync.formats.fp8 import quantize_slots_triton
        from weightsync.formats.fp8.spec import BLOCK_FP8

        device = next(self.actor.model[0].parameters()).device  # asked every sync: not a walk of every parameter
        return manifest.quantization == BLOCK_FP8 and device.type == "cuda" and quantize_slots_triton.available()

    @staticmethod
    def _finite(flat, buffers: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """`buffers`, or None when a quantized block is not finite (one host synchronisation per sync)."""
        if flat.finite():
            return buffers
        log.warning("FP8 flat buckets: %s; the sync takes the per-tensor export", flat.non_finite_error())
        return None
