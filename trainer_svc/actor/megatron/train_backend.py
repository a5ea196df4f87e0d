"""The training backend for MegatronActor: megatron-core's forward/backward schedule, TP-aware clipping.

Micro-batches go through `get_forward_backward_func()` (no pipelining, 1F1B, or interleaved for
VPP, chosen by megatron from the parallel state). Pipelined schedules exchange fixed-shape
activations, so every micro-batch is padded to one [micro_batch_size, seq_len] shape (padding rows
have an all-zero mask and add nothing to the loss), and with VPP the number of micro-batches is
padded to a multiple of PP.

Optimizer: torch AdamW over this rank's parameter shards, with megatron's gradient-norm rule
(TP-sharded params summed over the model-parallel group, TP-replicated ones counted once) and
DP gradient averaging. megatron-core 0.16.1's own optimizer cannot run on a CPU: its
`FP32Optimizer.__init__` allocates `torch.tensor([1.0], device='cuda')` unconditionally
(optimizer.py), and `get_megatron_optimizer` needs the model wrapped in megatron's DDP, which
would change `actor.model` under the export code. The AdamW update is the same math.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from trainer_svc.train.batch import Batch


def _pad_rows(mb: Batch, rows: int, width: int) -> Batch:
    """Pad a micro-batch to [rows, width] with masked-out rows/columns."""

    def pad(t):
        if t is None:
            return None
        out = torch.zeros((rows, width), dtype=t.dtype)
        out[: t.shape[0], : t.shape[1]] = t
        return out

    adv = torch.zeros(rows)
    adv[: mb.size] = mb.advantages
    return replace(
        mb,
        tokens=pad(mb.tokens),
        attention=pad(mb.attention),
        targets=pad(mb.targets),
        mask=pad(mb.mask),
        old_logp=pad(mb.old_logp),
        advantages=adv,
        ref_logp=pad(mb.ref_logp),
    )


def _to(mb: Batch, dev: torch.device) -> Batch:
    if dev.type == "cpu":
        return mb
    mv = lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
    return replace(
        mb,
        tokens=mv(mb.tokens),
        attention=mv(mb.attention),
        targets=mv(mb.targets),
        mask=mv(mb.mask),
        old_logp=mv(mb.old_logp),
        advantages=mv(mb.advantages),
        ref_logp=mv(mb.ref_logp),
    )


class _CpuZerosTorch:
    """`torch` as seen by megatron's schedules module, except that zeros(device="cuda") lands on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def _schedules_on_cpu():
    """megatron-core 0.16.1's three schedules allocate their token counter with `device="cuda"`
    (schedules.py: `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`), which
    raises on a CPU-only torch. For the duration of one schedule call, and only without CUDA, the
    module's `torch` name points at a proxy that places that tensor on CPU. (Belongs with the other
    patches in trainer_svc/actor/megatron/compat.py; kept here until it moves.)"""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.pipeline_parallel import schedules

    original = schedules.torch
    schedules.torch = _CpuZerosTorch()
    try:
        yield
    finally:
        schedules.torch = original


class MegatronBackend:
    def __init__(self, actor):
        from megatron.core import parallel_state as ps

        self.actor = actor
        self.chunks = actor.model
        self.ps = ps
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        self.vpp = len(self.chunks)
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.vocab_size = int(actor.config.vocab_size)
        self.device = next(self.chunks[0].parameters()).device
        # the rank that holds the pipeline output of TP rank 0 / DP rank 0; it broadcasts results
        self.output_src = actor.rmap.stage_leader[-1] if hasattr(actor, "rmap") else 0

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for c in self.chunks for p in c.parameters() if p.requires_grad]

    def _norm_params(self) -> set[int]:
        """ids of the params whose squared grads this rank adds to the global norm.

        Megatron marks TP-sharded params with `tensor_model_parallel`, but in 0.16.1 only when it
        initialises them (`perform_initialization=True`; a model built to load HF weights has
        none). So sharding is read from the owning layer type: vocab-parallel embeddings and
        column-parallel linears are sharded, a row-parallel linear's weight is (its bias is not);
        anything else (norms) is replicated and counted on TP rank 0 only. A tied output weight on
        the last stage duplicates the first stage's embedding and is not counted again.
        """
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        tp_rank0 = self.ps.get_tensor_model_parallel_rank() == 0
        first_stage = self.ps.is_pipeline_first_stage(ignore_virtual=True)
        keep: set[int] = set()
        for c in self.chunks:
            for mod in c.modules():
                for name, p in mod.named_parameters(recurse=False):
                    sharded = (
                        bool(getattr(p, "tensor_model_parallel", False))
                        or isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding))
                        or (isinstance(mod, RowParallelLinear) and name == "weight")
                    )
                    if getattr(p, "shared", False) and not first_stage:
                        continue
                    if sharded or tp_rank0:
                        keep.add(id(p))
        return keep

    def modules(self) -> list[torch.nn.Module]:
        return list(self.chunks)

    def frozen_copy(self) -> list[torch.nn.Module]:
        """A second set of chunks with the same layout and a copy of the current weights.

        (GPTModel holds process groups, so it cannot be deep-copied: build fresh chunks, load the
        state dict. Building re-seeds the RNGs, so their states are put back afterwards.)"""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from trainer_svc.actor.megatron.model import build_chunks

        cpu_state, tracker = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
        try:
            ref = build_chunks(
                self.actor.spec,
                self.actor.par,
                init_weights=False,
                params_dtype=next(self.chunks[0].parameters()).dtype,
            )
        finally:
            torch.set_rng_state(cpu_state)
            get_cuda_rng_tracker().set_states(tracker)
        for r, c in zip(ref, self.chunks):
            r.load_state_dict(c.state_dict())
            r.eval()
        for c in ref:
            for p in c.parameters():
                p.requires_grad_(False)
        return ref

    def make_optimizer(self, s) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=s.lr, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps, weight_decay=s.weight_decay
        )

    def barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    # ---- forward / backward -------------------------------------------------------------
    def run(
        self,
        mbs: list[Batch],
        fn: Callable,
        out_shape: Callable,
        *,
        train: bool,
        modules: list[torch.nn.Module] | None = None,
    ) -> list[torch.Tensor]:
        """Run `fn(logits_shard [b, s, V/tp], mb) -> (loss or None, out)` on every micro-batch's output
        through megatron's schedule; back-propagates when `train`. Returns the outs on every rank."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunks = modules or self.chunks
        rows = max(mb.size for mb in mbs)
        width = max(mb.tokens.shape[1] for mb in mbs)
        padded = [_pad_rows(mb, rows, width) for mb in mbs]
        if self.vpp > 1 and len(padded) % self.pp:
            blank = _pad_rows(replace(mbs[0], mask=torch.zeros_like(mbs[0].mask)), rows, width)
            padded += [blank] * (self.pp - len(padded) % self.pp)
        n = len(padded)
        outs: list[torch.Tensor] = []
        dev = self.device
        pos = torch.arange(width, device=dev).unsqueeze(0).expand(rows, width)

        def forward_step(data_iterator, model):
            mb = _to(next(data_iterator), dev)
            output = model(mb.tokens, pos, attention_mask=None)

            def loss_func(logits):
                loss, out = fn(logits, mb)
                outs.append(out.detach().float().cpu())
                if loss is None:
                    loss = logits.sum() * 0.0
                # megatron divides a 2-tuple loss by num_microbatches; ours is already the
                # micro-batch's share of the batch loss
                return loss * n, {}

            return output, loss_func

        for c in chunks:
            c.eval()  # no dropout: RL log-probs must match the rollout engine's
            if not torch.cuda.is_available():
                # batched p2p ends in torch.cuda.synchronize() (p2p_communication.py, batch_p2p_sync);
                # megatron's plain isend/irecv path works on gloo without a device sync
                c.config.batch_p2p_comm = False
        with torch.set_grad_enabled(train), _schedules_on_cpu():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(padded) for _ in chunks],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=n,
                seq_length=width,
                micro_batch_size=rows,
                forward_only=not train,
            )
        return self._broadcast_outs(outs, [out_shape(mb) for mb in padded])

    def _broadcast_outs(self, outs: list[torch.Tensor], shapes: list[tuple]) -> list[torch.Tensor]:
        """Pipeline outputs live on the last stage; every rank (rank 0 above all) needs them."""
        if self.pp == 1:
            return outs
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        flat = (
            torch.cat([o.reshape(-1).float() for o in outs])
            if dist.get_rank() == self.output_src
            else torch.zeros(numel)
        )
        flat = flat.to(self.device)  # the default group is NCCL on GPU hosts
        dist.broadcast(flat, src=self.output_src)
        flat = flat.cpu()
        res, off = [], 0
        for s in shapes:
            k = int(torch.Size(s).numel())
            res.append(flat[off : off + k].reshape(s))
            off += k
        return res

    # ---- optimizer ----------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        if (
            self.ps.get_expert_model_parallel_world_size() > 1
            or self.ps.get_expert_tensor_parallel_world_size() != self.tp
        ):
            # expert grads must be averaged over the expert-data-parallel group and counted once per
            # EP rank in the norm; the code below treats every param as dense and would mix experts
            raise ValueError(
                "train_step with EP>1 or expert TP != TP is not supported yet (export, load and "
                "log-probs are); train with ep=1"
            )
        params = [p for p in self.parameters() if p.grad is not None]
        if self.dp > 1:
            group = self.ps.get_data_parallel_group()
            for p in params:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(self.dp)
        self._sync_tied_embedding_grads()
        # megatron's rule: each distinct parameter element counted once, summed over TP x PP
        if not hasattr(self, "_counted"):
            self._counted = self._norm_params()
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in params:
            if id(p) in self._counted:
                sq += p.grad.double().pow(2).sum()
        if dist.get_world_size() > 1:
            dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        optimizer.step()
        return norm

    def _sync_tied_embedding_grads(self) -> None:
        """Tied embeddings with PP > 1: the first stage's embedding and the last stage's output copy
        are one parameter; megatron keeps them equal by summing their grads over the embedding group."""
        if self.pp == 1 or not self.ps.is_rank_in_embedding_group(ignore_virtual=True):
            return
        for c in self.chunks:
            if getattr(c, "share_embeddings_and_output_weights", False):
                w = c.shared_embedding_or_output_weight()
                if w is not None and w.grad is not None:
                    dist.all_reduce(w.grad, group=self.ps.get_embedding_group())
