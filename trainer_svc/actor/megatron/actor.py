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

from trainer_svc.actor.base import Actor
from trainer_svc.actor.megatron.flat_buckets import FlatBuckets
from trainer_svc.actor.megatron.parallel import Parallelism
from trainer_svc.actor.megatron.train_backend import MegatronBackend
from weightsync.bus.errors import TransportError
from weightsync.bus.plan import TensorMeta

log = logging.getLogger(__name__)


class MegatronActor(Actor):
    #: its flat buckets' FP8 weights go to an engine writer straight from the parameters (flat_fp8_weights)
    fp8_weights_from_parameters = True
    #: each rank of a multi-sender stream writes its own buckets from its parameters (own_flat_buckets)
    own_flat = True

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
        #: the syncs from flat buckets (the layout's buckets written straight from the parameters)
        self.flat = FlatBuckets(self)
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

    def flat_buckets(self, manifest, quantize: bool = True) -> list[torch.Tensor] | None:
        """Rank 0 of a single-sender sync: the manifest's buckets written straight from this model, or
        None (export and pack instead); flat_buckets.FlatBuckets.whole says when and how (`quantize`
        False: a block-FP8 layout's FP8 slots are left for `flat_quantize` or the engine writer)."""
        return self.flat.whole(manifest, quantize=quantize)

    def flat_fp8_weights(self):
        """The FP8 weights of the last `flat_buckets` (FlatBuckets.fp8_weights): a sync that writes
        into the engine dequantizes them straight from the parameters (fp8/trainer_writes.py)."""
        return self.flat.fp8_weights()

    def flat_quantize(self) -> ValueError | None:
        """The FP8 slots of the last `flat_buckets(quantize=False)` written now; the error naming a
        non-finite weight, or None (FlatBuckets.quantize_deferred)."""
        return self.flat.quantize_deferred()

    def flat_known_sums(self):
        """The word sums the last `flat_buckets` already has of its buckets (its FP8 quantizer's
        slots: checksum_regions.KnownSums), so their checksums read only the other bytes; or None."""
        return self.flat.known_sums()

    def own_flat_buckets(self, manifest) -> list[torch.Tensor] | None:
        """Every rank of a multi-sender stream: the buckets it owns written straight from its
        parameters, [] on a rank without buckets that sent its shards, or None (export and pack
        instead); FlatBuckets.own (a collective of the TP group at TP > 1)."""
        return self.flat.own(manifest)

    def decline_own_flat(self, manifest) -> None:
        """A rank of a multi-sender stream that packs for its own reasons: FlatBuckets.decline."""
        self.flat.decline(manifest)

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
                    self.flat.tp_exchange(None, part=False)
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
