"""MegatronActor: the trainer's Megatron-core backend behind the `Actor` protocol.

Under torchrun every rank builds the same actor (construction, including an optional HF load, is
collective). Global rank 0 then hosts the services and calls the public methods, each of which
first broadcasts a command; every other rank calls `worker_loop()`, which runs the matching
collective until rank 0 calls `shutdown()`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from trainer_svc.actor.megatron.parallel import Parallelism
from trainer_svc.actor.megatron.train_backend import MegatronBackend
from weightsync.bus.errors import TransportError
from weightsync.bus.plan import TensorMeta

log = logging.getLogger(__name__)


class MegatronActor:
    def __init__(
        self,
        hf_config,
        *,
        tp: int = 1,
        pp: int = 1,
        vpp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        seed: int = 0,
        export_dtype: torch.dtype = torch.float32,
        weights_dir: str | None = None,
        params_dtype: torch.dtype = torch.float32,
        init_weights: bool | None = None,
        converter: str = "builtin",
        mtp: str = "off",
        expert_layout: str = "sequential",
        megatron_checkpoint: str | None = None,
    ):
        """ep/etp: expert (tensor) parallel sizes for MoE models; mtp: carry the checkpoint's
        multi-token-prediction layers under 'deepseek' or 'mimo' names ('off': ignore them);
        expert_layout: 'sequential' (one module per expert) or 'grouped' (megatron's GroupedMLP);
        megatron_checkpoint: start from this Megatron torch_dist checkpoint (any TP/PP layout)
        instead of HF weights (dist_ckpt.py)."""
        if weights_dir and megatron_checkpoint:
            raise ValueError("weights_dir and megatron_checkpoint both given: start from one of them")
        from trainer_svc.actor.megatron.hf_meta import build_spec, export_metas
        from trainer_svc.actor.megatron.model import build_chunks
        from trainer_svc.actor.megatron.parallel import init_model_parallel, rank_map
        from weightsync.publisher.commands import CommandChannel

        #: the model's facts (family, dims, HF shapes, MTP), read from the HF config once
        self.spec = build_spec(hf_config, mtp)
        self.config = hf_config
        self.family = self.spec.family
        self.par = Parallelism(tp, pp, vpp, ep=ep, etp=etp)
        self.export_dtype = export_dtype
        init_model_parallel(self.par)
        self.rmap = rank_map()
        self.channel = CommandChannel()
        #: rank 0 raises a sync's flag to end every rank's NCCL broadcasts (weightsync/publisher/multisender.py)
        self.stream_flags = self.channel.flags
        #: global rank -> the UUID of the GPU it exports on ("" on CPU): NCCL takes one rank per GPU
        #: in a group, so rank 0 keeps a rollout on a sending rank's GPU out of that rank's group
        gpus = self.channel.gather({"gpu": _own_gpu_uuid()})  # a collective: every rank is in __init__
        self.rank_gpus: list[str] = [g["gpu"] for g in gpus] if gpus else []
        self._metas = export_metas(self.spec, export_dtype)
        #: this rank's GPTModel chunks (one per virtual pipeline stage); a training step uses these
        self.model = build_chunks(
            self.spec,
            self.par,
            seed=seed,
            params_dtype=params_dtype,
            init_weights=(weights_dir is None and megatron_checkpoint is None)
            if init_weights is None
            else init_weights,
            expert_layout=expert_layout,
        )
        from trainer_svc.actor.megatron.bridge import make_converter

        #: None: the built-in rule tables convert; else a bridge package does (bridge.py), and the
        #: export order becomes the bridge's, checked once here against the built-in plan
        self.converter = make_converter(converter, self.spec, self.par, params_dtype)
        if self.converter is not None:
            self._metas = self.converter.plan(self.model, self._metas)
        #: the model laid out as the current layout's buckets (flat_buckets), once a sync asked for it
        self._flat = None
        self._flat_refused = ""  # the layout digest FlatExport could not plan (flat_buckets packs instead)
        self._tp = None  # at TP > 1: this rank's TP group as the flat export's exchange sees it (tp_gather.py)
        #: export_owners(), computed at the first sync (the spec, parallelism and rank map are fixed)
        self._owners: tuple[int, ...] | None = None
        #: what the last funnelled export moved to rank 0 (bytes of other stages' tensors)
        self.export_stats: dict = {}
        self.version = 0
        if weights_dir:
            self._load_hf(weights_dir)
        elif megatron_checkpoint:
            self._load_megatron(megatron_checkpoint)
        self.version = 1
        #: completed optimizer steps, and the training state (optimizer, reference) once training starts
        self.step = 0
        self.train_state = None

    @classmethod
    def create(
        cls,
        hf_config,
        *,
        tp: int = 1,
        pp: int = 1,
        vpp: int = 1,
        ep: int = 1,
        seed: int = 0,
        export_dtype: torch.dtype = torch.float32,
        weights_dir: str | None = None,
        mtp: str = "off",
        converter: str = "builtin",
        megatron_checkpoint: str | None = None,
        params_dtype: torch.dtype = torch.float32,
    ) -> "MegatronActor":
        return cls(
            hf_config,
            tp=tp,
            pp=pp,
            vpp=vpp,
            ep=ep,
            seed=seed,
            export_dtype=export_dtype,
            weights_dir=weights_dir,
            mtp=mtp,
            converter=converter,
            megatron_checkpoint=megatron_checkpoint,
            params_dtype=params_dtype,
        )

    @classmethod
    def from_pretrained(cls, path: str, **kw) -> "MegatronActor":
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(path, local_files_only=True), weights_dir=path, **kw)

    # ---- Actor protocol -------------------------------------------------------------------------
    def export_metas(self) -> list[TensorMeta]:
        return list(self._metas)

    def export_owners(self) -> list[int]:
        """The global rank that assembles each tensor of `export_metas()` (its bus sender when every
        owner streams its own); all 0 with a bridge converter, which funnels through rank 0."""
        if self.converter is not None:
            return [0] * len(self._metas)
        if self._owners is None:  # from config alone and asked at every sync's plan: walked once (ms of Python)
            from trainer_svc.actor.megatron.export import export_owners

            self._owners = tuple(export_owners(self.spec, self.par, self.rmap))
        return list(self._owners)

    def flat_buckets(self, manifest) -> list[torch.Tensor] | None:
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
        """
        par = self.par
        if not manifest.layout_digest or self.converter is not None or (par.pp, par.vpp, par.ep) != (1, 1, 1):
            return None
        if self.rmap.rank != 0:
            return None
        quantized = manifest.quantization is not None
        if par.tp > 1:
            if quantized or not self._tp_flat_layout():
                return None
            # the other TP ranks send their shards (or hear that rank 0 exports instead): worker_loop
            self.channel.send("flat_join")
            return self._flat_tp(manifest, part=False)
        if quantized and not self._quantizes_in_place(manifest):
            return None
        return self._flat_buckets(manifest, part=False)

    def own_flat_buckets(self, manifest) -> list[torch.Tensor] | None:
        """Every rank of a multi-sender stream: `manifest`'s buckets (the ones this rank owns,
        `Manifest.buckets_of`) written straight from this rank's parameters as `flat_buckets` writes
        the whole model's, so the rank needs neither its export nor the pack copy.

        None (the rank exports and packs its buckets instead) unless no bridge converter, an
        unquantized layout with a layout digest, and the parameters mostly in the slots' dtype (as
        `flat_buckets`); and either

        - TP = expert-TP = 1 (pipeline stages, virtual ones too, and any EP: an EP rank writes its own
          experts, the stage's dense leader the dense tensors too). The decision is then safe per rank:
          the multi-sender export runs no collective (export.runs_no_collective), so a rank that skips
          it leaves no other rank waiting, whichever way the others went; or
        - TP > 1 at expert-TP = 1 (any EP): a collective of the TP group (tp_gather.py), which every
          rank of a stage's TP group must call at the same point of a sync with its own buckets (the
          stage's dense ones on the leader, an EP rank's experts, or none); [] on a rank without
          buckets that sent its shards. The group agrees first, so a plan refused on any rank of
          it (or `decline_own_flat`) makes every rank of the group export."""
        from trainer_svc.actor.megatron.export import runs_no_collective

        if not manifest.layout_digest or self.converter is not None or manifest.quantization is not None:
            return None
        if not runs_no_collective(self.par):
            return self._flat_tp(manifest, part=True) if self._tp_flat_layout() else None
        if not manifest.buckets:
            return None
        return self._flat_buckets(manifest, part=True)

    def decline_own_flat(self, manifest) -> None:
        """A rank of a multi-sender stream that packs this sync for its own reasons, where
        `own_flat_buckets` would have been a collective: its TP group hears it, and every rank of the
        group exports (a no-op where the flat path is decided per rank)."""
        from trainer_svc.actor.megatron.export import runs_no_collective

        if not manifest.layout_digest or self.converter is not None or manifest.quantization is not None:
            return
        if not runs_no_collective(self.par) and self._tp_flat_layout():
            self._flat_tp(manifest, part=True, decline=True)

    def _tp_flat_layout(self) -> bool:
        """Whether the flat export can run at this TP > 1 layout: dense TP only (experts unsplit:
        expert-TP = 1, any EP), no bridge converter. From config alone: the same on every rank."""
        par = self.par
        experts_split = bool(self.spec.dims.num_experts) and par.expert_tp > 1
        return par.tp > 1 and not experts_split and self.converter is None

    def _flat_tp(self, manifest, *, part: bool, decline: bool = False) -> list[torch.Tensor] | None:
        """At TP > 1, on every rank of a stage's TP group together (tp_gather.py): the leader plans
        its buckets (`manifest`, None on a rank with none), the group agrees, and then the leader's
        buckets are written, the other ranks sending it their shards. The leader's buckets, [] on the
        other ranks, or None on every rank of the group (each exports instead)."""
        from trainer_svc.actor.megatron import tp_gather
        from trainer_svc.actor.megatron.model import named_parameters_global

        if not self.rmap.in_replica0:
            # holds no dense tensor any export gathers: its export runs no collective, and its buckets (an
            # EP rank's unsplit experts, if any) are planned as at TP = 1, on this rank's word alone
            owns = manifest is not None and bool(manifest.buckets)
            return self._flat_buckets(manifest, part=part) if owns and not decline else None
        if self._tp is None:
            self._tp = tp_gather.tp_group(self.spec, self.par, self.rmap.pp_rank, self.rmap.tp_rank, self.export_dtype)
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
        if not tp_gather.agree(ok, g, self.parameters()[0].device):
            return None
        try:
            if g.tp_rank != 0:
                tp_gather.send_shards(named_parameters_global(self.model), g)
            return [] if flat is None else flat.refresh()
        except Exception as exc:
            # every rank of the group went flat: none may fall back to the export's gathers now (they
            # would wait for partners that are not coming), so the sync fails on this rank instead
            self._flat = None  # its buffers may hold part of an exchange
            raise TransportError(f"rank {self.rmap.rank}: the TP group's flat-export exchange failed: {exc}") from exc

    def _flat_buckets(self, manifest, *, part: bool) -> list[torch.Tensor] | None:
        """The buckets of `manifest` from the layout's FlatExport (`_plan`), written (None: pack instead)."""
        flat = self._plan(manifest, part=part)
        return None if flat is None else self._finite(flat, flat.refresh())

    def _plan(self, manifest, *, part: bool, tp=None):
        """The layout's FlatExport, planned once per layout digest and again when a parameter moved
        (None: pack instead). One plan is kept: a sync of another layout (the funnel after a
        multi-sender sync) plans again, moving the aliased parameters into its buckets."""
        quantized = manifest.quantization is not None
        flat = self._flat
        if flat is not None and flat.digest == manifest.layout_digest and not flat.stale():
            return flat  # the parameters are where the plan found them: same dtypes too
        params = self.parameters()
        slot_dtype = torch.bfloat16 if quantized else self.export_dtype  # fp8_export keeps the rest in bf16
        cast = sum(p.numel() for p in params if p.dtype != slot_dtype)
        if cast * 8 > sum(p.numel() for p in params):
            return None
        if self._flat_refused == manifest.layout_digest:
            return None
        from trainer_svc.actor.megatron.flat_export import FlatExport

        self._flat = None  # the previous layout's buckets are dropped before the new ones are built
        try:
            self._flat = FlatExport(manifest, self.model, self.spec, part=part, tp=tp)
        except ValueError as exc:  # not planned again for this layout: every sync would pay the attempt
            self._flat_refused = manifest.layout_digest
            log.warning("flat buckets refused for layout %s: %s; syncs pack instead", manifest.layout_digest, exc)
            return None
        return self._flat

    def _quantizes_in_place(self, manifest) -> bool:
        """Whether a block-FP8 layout can be quantized into the flat buckets on this rank's device."""
        from weightsync.formats import fp8_slots_triton
        from weightsync.formats.fp8_spec import BLOCK_FP8

        device = self.parameters()[0].device
        return manifest.quantization == BLOCK_FP8 and device.type == "cuda" and fp8_slots_triton.available()

    @staticmethod
    def _finite(flat, buffers: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """`buffers`, or None when a quantized block is not finite (one host synchronisation per sync)."""
        if flat.finite():
            return buffers
        log.warning("FP8 flat buckets: %s; the sync takes the per-tensor export", flat.non_finite_error())
        return None

    @property
    def rank(self) -> int:
        return self.rmap.rank

    def export_own_tensors(self, stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank: run the export without the funnel; yields the tensors this rank owns."""
        return self._export(to_rank0=False, stats=stats)

    def run_senders(self, job: dict) -> list[dict]:
        """Rank 0: every rank streams the buckets it owns (weightsync.publisher.multisender); their reports."""
        from dataclasses import asdict

        from weightsync.publisher.multisender import SendJob, run_sender

        self._check_driver("run_senders")
        self.channel.send("stream", **job)
        return self.channel.gather(asdict(run_sender(self, SendJob.from_args(job))))

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._check_driver("export_tensors")
        self.channel.send("export")
        self.export_stats = {}
        it = self._export(stats=self.export_stats)
        try:
            # not `yield from`: closing this generator would close `it` too, and it must be drained
            for item in it:
                yield item
        finally:
            # the workers are inside the same sequence of collectives: finish it (discarding) if
            # the consumer stopped early, or the whole job would hang on the next command
            for _ in it:
                pass

    def load_hf(self, path: str) -> None:
        self._check_driver("load_hf")
        self.channel.send("load_hf", path=str(path))
        self._load_hf(str(path))

    def load_megatron(self, path: str) -> None:
        """Replace the weights with a Megatron torch_dist checkpoint's (any TP/PP layout)."""
        self._check_driver("load_megatron")
        self.channel.send("load_megatron", path=str(path))
        self._load_megatron(str(path))

    def save_megatron(self, directory: str, *, iteration: int, names: str = "megatron") -> str:
        """Collective (every rank calls it, e.g. through a training op): write the weights as a
        Megatron torch_dist checkpoint `<directory>/iter_{iteration:07d}`; returns that path."""
        from trainer_svc.actor.megatron.dist_ckpt import save_torch_dist

        return str(
            save_torch_dist(self.model, directory, self.spec, iteration=iteration, version=self.version, names=names)
        )

    def save_hf(self, out_dir: str) -> None:
        """Write a transformers-loadable directory (config.json + safetensors) from the export."""
        from trainer_svc.actor.megatron.hf_writer import write_hf_dir

        self._check_driver("save_hf")
        self.channel.send("export")
        it = self._export()
        try:
            write_hf_dir(out_dir, self.config, self._metas, it)
        finally:
            # the workers are inside the export's collectives: a write that failed part-way must
            # still finish them, or the whole job hangs on the next command
            for _ in it:
                pass

    def num_parameters(self) -> int:
        return sum(math.prod(m.shape) for m in self._metas)

    def describe_parallelism(self) -> str:
        return f"megatron-core {self.par.describe()} world={dist.get_world_size()} (local spec)"

    def hf_config(self):
        return self.config

    def train_backend(self) -> MegatronBackend:
        return MegatronBackend(self)

    # ---- multi-rank plumbing --------------------------------------------------------------------
    def worker_loop(self) -> None:
        """Ranks != 0: run rank 0's commands until it calls `shutdown()`."""
        if self.rmap.rank == 0:
            raise RuntimeError("worker_loop() is for ranks != 0; rank 0 drives the actor")
        while True:
            op, args = self.channel.receive()
            log.debug("rank %d: command %s %s", self.rmap.rank, op, args)
            if op == "shutdown":
                return
            if op == "export":
                for _ in self._export():
                    pass
            elif op == "stream":
                from dataclasses import asdict

                from weightsync.publisher.multisender import SendJob, run_sender

                self.channel.gather(asdict(run_sender(self, SendJob.from_args(args))))
            elif op == "flat_join":  # rank 0's flat_buckets at TP > 1: this rank's shards, if the group agrees
                try:
                    self._flat_tp(None, part=False)
                except TransportError:  # rank 0 fails its in-place attempt too, and exports: a command follows
                    log.exception("rank %d: flat_join", self.rmap.rank)
            elif op == "load_hf":
                self._load_hf(args["path"])
            elif op == "load_megatron":
                self._load_megatron(args["path"])
            else:
                from trainer_svc.train.collective import handle_worker_command  # training ops live there

                if not handle_worker_command(self, op, args):
                    raise ValueError(f"unknown worker command {op!r}")

    def shutdown(self) -> None:
        """On rank 0: end every worker loop. Idempotent; a no-op on a single-rank job."""
        if self.rmap.rank == 0 and not getattr(self, "_shut", False):
            self._shut = True
            self.channel.send("shutdown")

    def parameters(self):
        return [p for chunk in self.model for p in chunk.parameters()]

    def _check_driver(self, what: str) -> None:
        if self.rmap.rank != 0:
            raise RuntimeError(f"{what}() is driven from global rank 0; rank {self.rmap.rank} runs worker_loop()")

    def _export(self, to_rank0: bool = True, stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if self.converter is not None:
            if not to_rank0:
                raise ValueError(f"converter={self.converter!r} exports through rank 0 only; use bus senders=rank0")
            return self.converter.export(self.model, self._metas)
        from trainer_svc.actor.megatron.export import export_tensors

        return export_tensors(
            self.model, self.spec, self.par, self.rmap, self.export_dtype, to_rank0=to_rank0, stats=stats
        )

    def _load_hf(self, path: str) -> None:
        from trainer_svc.actor.megatron.load import load_hf_into

        if self.converter is not None:
            self.converter.load(self.model, path)
        else:
            load_hf_into(self.model, path, self.spec, self.par)
        self.version += 1

    def _load_megatron(self, path: str) -> None:
        from trainer_svc.actor.megatron.dist_ckpt import load_torch_dist

        load_torch_dist(self.model, path, self.spec)
        self.version += 1


def _own_gpu_uuid() -> str:
    from weightsync.bus.gpu import uuid_of

    return uuid_of(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else ""
