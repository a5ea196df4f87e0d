"""The Megatron model as a manifest's buckets: the export straight into the bus.

The per-parameter export (export.py) casts, splits and assembles every tensor, and the pipeline
then copies it into a bucket: a second pass over every byte and several launches per tensor. The
layout of every HF tensor in the buckets is known before any byte moves and does not change between
syncs, so it is planned once per layout (the manifest's digest) and each sync moves each byte at
most once. On one rank holding the whole model (TP = PP = EP = 1, the colocated case):

- a parameter whose HF tensors are its own bytes in order (the export dtype, an identity or the
  [gate; up] split, no vocabulary padding, its tensors adjacent in one bucket) is moved into its
  bucket slots once, and the parameter then lives there (as the hf actor's do: hf/actor.py
  `flat_buckets`); training, loads and exports go on using the same parameter, and a sync sends it
  with no copy at all;
- every other HF tensor (the query-group interleaved QKV, a padded vocabulary, a parameter shared
  by two slots, one split across buckets, an fp32 norm cast into a bf16 slot, a grouped expert
  layout's experts: transposed views of its weight1/weight2) is written from its
  parameter into its slot at each sync by strided-view copies (hf_copy.py), planned once as
  contiguous runs in an address table: on a GPU one Triton launch per (dtype pair, alignment) for
  the whole model, not one kernel per copy (weightsync/bus/copy/copy_runs.py); off the GPU one batched
  `_foreach_copy_`, which writes the same bits.

With several senders (pipeline stages and expert-parallel ranks, TP = expert-TP = 1:
weightsync/publisher/multisender.py) each rank plans the same way the buckets it owns, from its own
parameters under their global layer and expert numbers (`part`): a stage's layers, and the
embedding or head of the first or last stage; with EP > 1 the stage's dense leader its dense tensors
and its local experts, every other EP rank its local experts only (the dense replicas it also holds
are another rank's to send).

At TP > 1 (experts unsplit: expert-TP = 1; `tp`) the stage leader (TP rank 0, which owns the stage's
dense tensors) plans its buckets over its own shards and the other TP ranks' ones, which they send it at each
sync (tp_gather.py: the list and its order follow from config alone). A remote vocabulary shard
whose rows all lie inside the HF vocabulary (the embedding or head rows, not the padding past it) is
received straight into its slot; every other remote shard into its region of one buffer allocated
with the plan and reused at every sync, from which, with the leader's own shards, the planned copy
table writes the slots (QKV per query group, gate/up, the row-parallel dim-1 splits): on a GPU one
batch of receives and a launch or two per sync. A sharded parameter is never aliased (its slot is
TP times its shard); a replicated one (a norm, a replicated bias) is, as at TP = 1. The other TP ranks
must run the exchange whenever the leader refreshes: the actor agrees on the path across the group
first (MegatronActor._flat_tp).

Extra memory: the converted tensors' bytes (for a Qwen2 model, QKV weights and biases: about 6% of
the export), kept with the buckets; at TP > 1 on the leader, the converted tensors (every sharded
one) and the gather buffer ((TP-1)/TP of the sharded bytes, less the vocabulary shards that land in
their slots).

A block-FP8 layout (`manifest.quantization`, weightsync/formats/fp8/export.py; TP = 1 only, the
actor packs it at TP > 1) is planned the same way: its bf16 tensors as above, and every FP8 weight
quantized from its parameter straight into its e4m3 and scale slots by one Triton launch per bucket
(weightsync/formats/fp8/quantize_slots.py), its rows found through the same copy pairs; the bytes are those
the per-tensor export quantizes. The FP8 weights' slots (about half the model's bf16 bytes) are
then kept with the buckets, and a weight that is not whole rows of its parameter makes the plan
fail (the sync packs instead). Non-finite weights raise one device flag, read once per sync
(`finite()`).
"""

from __future__ import annotations

import math

import torch

from trainer_svc.actor.megatron.export import as_bytes
from trainer_svc.actor.megatron.hf_copy import copy_pairs
from trainer_svc.actor.megatron.hf_meta import export_plan
from trainer_svc.actor.megatron.model import named_parameters_global
from trainer_svc.actor.megatron.rules.base import Rule
from trainer_svc.actor.megatron.tp_gather import ShardReceives, TpGroup
from weightsync.bus.copy.copy_runs import BatchedCopy
from weightsync.bus.plan import Manifest, Slot
from weightsync.formats.fp8 import quantize_slots
from weightsync.formats.fp8.spec import FP8_DTYPE, SCALE_SUFFIX
from weightsync.model_spec import ModelSpec


def _slot_view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    m = slot.meta
    return flat[slot.offset : slot.offset + m.nbytes].view(m.dtype).view(m.shape)


def _aliasable(p: torch.Tensor, rule: Rule, where: list[tuple[int, Slot]], dims, claimed: set[int]) -> bool:
    """Whether `p`'s storage, as it is, holds `where`'s slots back to back (so it can live there)."""
    if not isinstance(p, torch.nn.Parameter) or id(p) in claimed or not rule.transform.to_hf_views:
        return False
    if not p.is_contiguous() or any(s.meta.dtype != p.dtype for _, s in where):
        return False
    if len({b for b, _ in where}) != 1:
        return False
    pos = where[0][1].offset
    for _, s in where:
        if s.offset != pos:  # an alignment gap, or not in this order
            return False
        pos += s.meta.nbytes
    if pos - where[0][1].offset != p.numel() * p.element_size():  # e.g. vocabulary padding rows
        return False
    # the transform's pieces must be the parameter's bytes in slot order (true of identity and
    # gate_up by construction; checked, since a wrong alias would send wrong bytes silently)
    pieces = rule.transform.to_hf(p.detach(), dims)
    at = p.data_ptr()
    for piece, (_, s) in zip(pieces, where, strict=True):
        if not piece.is_contiguous() or piece.data_ptr() != at or tuple(piece.shape) != s.meta.shape:
            return False
        at += s.meta.nbytes
    return True


class FlatExport:
    """One layout's buckets over one rank's whole model, or (`part`) over the buckets one sender rank
    owns (a pipeline stage's or an EP rank's tensors); `refresh()` writes the converted slots."""

    def __init__(
        self,
        manifest: Manifest,
        chunks,
        spec: ModelSpec,
        *,
        use_kernel: bool | None = None,
        part: bool = False,
        tp: TpGroup | None = None,
    ):
        """`part`: `manifest.buckets` are this rank's own (Manifest.buckets_of): a tensor none of whose
        HF names are in them is another rank's and is left out; every tensor in them must come from this
        rank's parameters (under their global names), or the plan fails. `tp`: this rank's TP group at
        TP > 1 (tp_gather.py); its leader's buckets then hold its stage's TP-sharded tensors, whose
        other shards `refresh()` receives from the group's other ranks (which must send them)."""
        if not manifest.layout_digest:
            raise ValueError("FlatExport needs manifest.layout_digest (a layout planned by ManifestCache)")
        self.digest = manifest.layout_digest
        # a slot's bucket by its position in manifest.buckets (= self.flats), which is its index only
        # when the manifest is the whole model's: a sender's own buckets keep their global indices
        slots = {s.meta.name: (k, s) for k, b in enumerate(manifest.buckets) for s in b.slots}
        params = named_parameters_global(chunks)
        device = next(iter(params.values())).device
        aliases: dict[int, list[tuple[torch.nn.Parameter, Slot]]] = {k: [] for k in range(len(manifest.buckets))}
        converted: list[tuple[Rule, str, list[tuple[int, Slot]]]] = []
        claimed: set[int] = set()
        planned = 0
        gathered: list[str] = []  # the TP-sharded parameters, in plan order
        for rule, site, names in export_plan(spec):
            missing = [n for n in names if n not in slots]
            if part and len(missing) == len(names):
                continue  # another sender's tensor
            mname = rule.megatron_name(site)
            p = params.get(mname)
            if p is None:
                raise ValueError(
                    f"tensor {mname}: not on this rank; the flat export needs the parameters of every tensor "
                    "in the buckets it writes (and at TP > 1 the shards of its TP group: its leader owns them)"
                )
            if missing:
                raise ValueError(f"tensor {missing[0]}: exported but not in the manifest's buckets")
            where = [slots[n] for n in names]
            planned += len(names) + sum(_scale_of(n, slots) is not None for n in names)
            if tp is not None and not rule.expert and rule.tp_dim is not None:
                if tp.tp_rank != 0:
                    raise ValueError(f"tensor {mname}: TP-sharded, in the buckets of TP rank {tp.tp_rank} (not 0)")
                gathered.append(mname)
                converted.append((rule, mname, where))
            elif _aliasable(p, rule, where, spec.dims, claimed):
                claimed.add(id(p))
                aliases[where[0][0]].append((p, where[0][1]))
            else:
                converted.append((rule, mname, where))
        if planned != len(slots):
            raise ValueError(f"the manifest has {len(slots)} tensors, the export plan {planned}")
        if tp is not None and tp.tp_rank == 0 and tuple(gathered) != tp.names:
            # the other TP ranks send tp.names in order (config alone): the receives must be the same list
            raise ValueError(
                f"the buckets hold {len(gathered)} of the stage's {len(tp.names)} TP-sharded tensors: the flat "
                "export at TP > 1 needs the stage leader to own them all"
            )
        self._aliased: list[tuple[torch.nn.Parameter, int]] = []  # (parameter, address of its slot)
        self.flats: list[torch.Tensor] = []
        with torch.no_grad():
            # bucket by bucket, as the hf actor: the extra memory is one bucket, not the model
            for b in manifest.buckets:
                flat = torch.zeros(b.nbytes, dtype=torch.uint8, device=device)  # gaps included: checksummed
                for p, slot in aliases[len(self.flats)]:
                    view = flat[slot.offset : slot.offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                    view.copy_(p)
                    p.data = view
                    self._aliased.append((p, view.data_ptr()))
                self.flats.append(flat)
        # sources are taken after the moves above: a parameter read here must be its new storage
        params = named_parameters_global(chunks)
        by_slot = {s.meta.name: _slot_view(self.flats[b], s) for b, s in slots.values()}
        remote = _RemoteShards(tp, converted, params, self.flats, device) if gathered else None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        weights: list[quantize_slots.SlotWeight] = []
        #: (parameter, address) of every source: one moved elsewhere since (a load that assigns new
        #: storage) makes this plan stale, so the next sync plans again instead of sending old bytes
        self._sources = list(self._aliased)
        for rule, mname, where in converted:
            # an FP8 weight's region is a stand-in with no memory: its pairs say where its rows are
            quant = [_scale_of(s.meta.name, slots) for _, s in where]
            stand = iter(quantize_slots.stand_ins([s.meta.shape for (_, s), q in zip(where, quant) if q is not None]))
            outs = [by_slot[s.meta.name] if q is None else next(stand) for (_, s), q in zip(where, quant)]
            p = params[mname]
            self._sources.append(_watched(p))
            mine = [
                quantize_slots.SlotWeight(s.meta.name, b, s.offset, q[1].offset, out, scale_bucket=q[0])
                for (b, s), q, out in zip(where, quant, outs)
                if q is not None
            ]
            shards = [p.detach(), *(remote.shards(mname) if remote is not None else [])]
            for dst, src in copy_pairs(rule, shards, outs, spec.dims):
                if _same_view(dst, src):  # a shard received into its slot
                    continue
                w = next((w for w in mine if _within(dst, w.stand_in)), None) if dst.is_meta else None
                if w is None:
                    pairs.append((dst, src))
                else:
                    w.pieces.append((dst, src))
            weights += mine
        if remote is not None and weights:
            raise ValueError("an FP8 layout at TP > 1: the flat export quantizes at TP = 1 only")
        #: the receives of the other TP ranks' shards (None at TP = 1), then the copies
        self._receives = remote.receives() if remote is not None else None
        self._copy = BatchedCopy(pairs, use_kernel=use_kernel)
        self._quant = quantize_slots.plan(self.flats, weights, use_kernel=use_kernel) if weights else None
        if weights and self._quant is None:
            raise ValueError(
                "an FP8 weight is not whole rows of its parameter: this layout cannot be quantized in place"
            )
        self._slot_ranges = None  # the FP8 and scale slots' byte ranges per bucket (known_sums), once
        self._quantized = False  # whether the FP8 and scale slots hold the last refresh's weights
        #: bytes of the FP8 weights and scales written by the quantize launches at each sync
        self.quantized_bytes = self._quant.bytes if self._quant is not None else 0
        self.aliased_bytes = sum(p.numel() * p.element_size() for p, _ in self._aliased)
        self.copied_bytes = sum(math.prod(d.shape) * d.element_size() for d, _ in pairs)
        self.copies = len(pairs)
        #: bytes received from the other TP ranks at each sync: straight into their slots, and in all
        self.landed_bytes = remote.landed_bytes if remote is not None else 0
        self.received_bytes = self._receives.bytes if self._receives is not None else 0
        #: the persistent buffer the other remote shards land in (allocated once per plan)
        self.gather_buffer_bytes = remote.buffer.numel() if remote is not None else 0
        #: kernel launches per sync for the copies (table-driven) and copies left to torch, one kernel each
        self.launches, self.torch_copies = len(self._copy.launches), self._copy.torch_pairs
        #: kernel launches per sync that quantize (one per bucket holding FP8 weights)
        self.quant_launches = len(self._quant.launches) if self._quant is not None and self._quant.use_kernel else 0

    def stale(self) -> bool:
        """A parameter's storage was replaced since the plan (the slots would not follow it)."""
        return any(p.data_ptr() != ptr for p, ptr in self._sources)

    def refresh(self, quantize: bool = True) -> list[torch.Tensor]:
        """Write every converted slot from its parameter (a launch or two) and quantize every FP8
        weight into its slots (a launch per bucket); the buckets. `quantize=False`: the FP8 and scale
        slots are left as they are (a sync that writes the weights into the engine from the parameters
        themselves, weightsync/formats/fp8/write_slots.py); `quantize()` writes them later if it must."""
        with torch.no_grad():
            if self._receives is not None:
                self._receives.run()
            self._copy.run()
            self._quantized = False
            if quantize:
                self.quantize()
        return self.flats

    def quantize(self) -> None:
        """Quantize every FP8 weight into its slots now (queued; `finite()` reads the flag)."""
        if self._quant is not None:
            with torch.no_grad():
                self._quant.run()
        self._quantized = True

    def fp8_weights(self) -> list[quantize_slots.SlotWeight]:
        """The FP8 weights: where their rows are in the parameters and their slots in the buckets."""
        return [] if self._quant is None else list(self._quant.weights)

    def finite(self) -> bool:
        """Whether every FP8 block of the last quantize was finite (one host synchronisation; True
        without FP8 weights)."""
        return self._quant is None or self._quant.finite()

    def known_sums(self):
        """The word sums the last refresh's quantize launches kept of what they wrote (its FP8 and
        scale slots: checksum_regions.KnownSums), so a bucket's checksum reads only its other
        bytes (the 16-bit tensors, about a quarter of a Qwen2's FP8 buckets); None without FP8
        weights, where a weight is not whole 32-bit words, or when the slots were not written since
        the last refresh (`quantize=False`)."""
        if self._quant is None or not self._quantized or self._quant.word_sums() is None:
            return None
        from weightsync.bus.copy.checksum_regions import KnownSums

        if self._slot_ranges is None:
            self._slot_ranges = self._quant.slot_ranges()
        return KnownSums(self._quant.word_sums(), self._slot_ranges)

    def non_finite_error(self) -> ValueError | None:
        """The error naming the first FP8 weight and block of the last refresh that is not finite."""
        return None if self._quant is None else self._quant.first_non_finite()


def _watched(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor whose storage a load would replace, its address) for a copy source: a parameter
    itself, or the parameter a view comes from (a grouped expert layout's experts are views into its
    weight1/weight2, param_names.py), since replacing that parameter's storage leaves the view's own
    address as it was."""
    base = p if isinstance(p, torch.nn.Parameter) or p._base is None else p._base
    return base, base.data_ptr()


def _scale_of(name: str, slots: dict[str, tuple[int, Slot]]) -> tuple[int, Slot] | None:
    """(bucket, scale slot) of an FP8 weight, None for a tensor that travels unquantized."""
    where = slots.get(name + SCALE_SUFFIX)
    if where is None or slots[name][1].meta.dtype != FP8_DTYPE:
        return None
    return where


def _within(view: torch.Tensor, stand_in: torch.Tensor) -> bool:
    """Whether a meta `view` lies in `stand_in` (stand-ins share one storage, disjoint)."""
    start = stand_in.storage_offset()
    return start <= view.storage_offset() < start + stand_in.numel()


def _same_view(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        dst.dtype == src.dtype
        and dst.data_ptr() == src.data_ptr()
        and dst.shape == src.shape
        and dst.stride() == src.stride()
    )


#: alignment of each remote shard in the gather buffer (bytes): the copy kernel's widest runs
_ALIGN = 64


class _RemoteShards:
    """Where the other TP ranks' shards of the sharded tensors land, planned once: a vocabulary shard
    whose rows all lie in its HF slot lands in the slot itself, every other one in its region of one
    buffer allocated here (reused at every sync); a region is seen as the shard it holds."""

    def __init__(self, tp: TpGroup, converted, params, flats: list[torch.Tensor], device):
        self.tp = tp
        self._targets: list[tuple[int, torch.Tensor]] = []  # (TP rank, bytes it lands in), in send order
        self._shards: dict[str, list[tuple[int, int, int] | None]] = {}  # per TP rank >= 1: slot rows, or None
        self.landed_bytes = 0
        sizes: dict[str, int] = {}
        for rule, mname, where in converted:
            if mname not in tp.names:
                continue
            p = params[mname]
            nbytes = p.numel() * tp.export_dtype.itemsize
            direct = [_rows_in_slot(rule, p, where, r, flats, tp.export_dtype) for r in range(1, len(tp.ranks))]
            self._shards[mname] = direct
            sizes[mname] = nbytes
        offsets, total = {}, 0
        for mname, direct in self._shards.items():
            for r, d in enumerate(direct, start=1):
                if d is None:
                    offsets[(mname, r)] = total
                    total += -(-sizes[mname] // _ALIGN) * _ALIGN
        self.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        for mname in tp.names:  # the order every other TP rank sends in
            p = params[mname]
            for r, d in enumerate(self._shards[mname], start=1):
                if d is None:
                    at = offsets[(mname, r)]
                    raw = self.buffer[at : at + sizes[mname]]
                else:
                    bucket, start, length = d
                    raw = flats[bucket][start : start + length]
                    self.landed_bytes += length
                self._targets.append((r, raw))
                self._views[(mname, r)] = raw.view(tp.export_dtype).view(p.shape)

    def shards(self, mname: str) -> list[torch.Tensor]:
        """The other TP ranks' shards of `mname` (TP ranks 1..), as where they land; none for a
        parameter that is not TP-sharded."""
        if mname not in self._shards:
            return []
        return [self._views[(mname, r)] for r in range(1, len(self.tp.ranks))]

    def receives(self) -> ShardReceives:
        return ShardReceives(self.tp, [(r, as_bytes(t)) for r, t in self._targets])


def _rows_in_slot(rule: Rule, p: torch.Tensor, where, r: int, flats, dtype) -> tuple[int, int, int] | None:
    """(bucket, byte offset, bytes) of TP rank r's vocabulary shard inside its HF slot when all its
    rows are HF rows (not the padding past the vocabulary) in the export dtype; else None."""
    if not rule.vocab or rule.tp_dim != 0 or len(where) != 1:
        return None
    bucket, slot = where[0]
    rows = p.shape[0]
    if (
        slot.meta.dtype != dtype
        or tuple(slot.meta.shape[1:]) != tuple(p.shape[1:])
        or (r + 1) * rows > slot.meta.shape[0]
    ):
        return None
    row_bytes = math.prod(p.shape[1:]) * dtype.itemsize
    return bucket, slot.offset + r * rows * row_bytes, rows * row_bytes
