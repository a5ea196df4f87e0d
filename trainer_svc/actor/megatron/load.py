"""HF -> Megatron: fill this rank's shards from an HF safetensors directory.

Each rank opens the files lazily and reads only its own rows/columns (`get_slice`), and only the
experts of its EP rank, so no rank ever holds a full model copy: peak extra memory is one shard's
HF pieces.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from trainer_svc.actor.megatron.model import named_parameters_global, padded_vocab_size
from trainer_svc.actor.megatron.parallel import Parallelism
from trainer_svc.actor.megatron.rules import Rule, rules_for
from weightsync.model_spec import ModelSpec


def _tp_slice(sl, full_shape, rule: Rule, tp: int, tp_rank: int, vocab_size: int) -> torch.Tensor:
    if rule.tp_dim is None:
        return sl[:]
    if rule.vocab:
        # rank r owns padded rows [r*n, (r+1)*n); rows past the HF vocab are padding (zeros)
        n = padded_vocab_size(vocab_size, tp) // tp
        start, stop = tp_rank * n, min((tp_rank + 1) * n, vocab_size)
        rows = sl[start:stop] if stop > start else torch.empty(0, *full_shape[1:])
        pad = torch.zeros(n - rows.shape[0], *full_shape[1:], dtype=rows.dtype)
        return torch.cat([rows, pad], dim=0)
    n = full_shape[rule.tp_dim] // tp
    start, stop = tp_rank * n, (tp_rank + 1) * n
    return sl[start:stop] if rule.tp_dim == 0 else sl[:, start:stop]


def index_safetensors(path: str) -> dict[str, Path]:
    """HF tensor name -> file holding it, for every *.safetensors file in `path`."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"hf_path {path}: no *.safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:  # checks the header against the file size
                for k in h.keys():
                    where[k] = f
        except SafetensorError as exc:
            raise ValueError(f"hf_path {path}: {f.name} is not a readable safetensors file ({exc})") from None
    return where


def agree_on_errors(error: str | None) -> None:
    """Raise the same ValueError on every rank if any rank failed.

    Ranks read different slices (another TP rank's rows, another EP rank's experts), so a missing or
    misshapen tensor may fail on one rank only; the others would go on into the next collective and
    wait for it forever. The lowest failing rank's message is broadcast as UTF-8 bytes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error:
            raise ValueError(error)
        return
    world = dist.get_world_size()
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    first = torch.tensor([dist.get_rank() if error else world], dtype=torch.int64, device=dev)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return
    msg = (error or "").encode()[:4096]
    n = torch.tensor([len(msg)], dtype=torch.int64, device=dev)
    dist.broadcast(n, src=src)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    if dist.get_rank() == src:
        buf.copy_(torch.frombuffer(bytearray(msg), dtype=torch.uint8))
    dist.broadcast(buf, src=src)
    raise ValueError(bytes(buf.cpu().numpy()).decode(errors="replace") + f" (on rank {src})")


def load_hf_into(chunks, path: str, spec: ModelSpec, par: Parallelism) -> None:
    """Collective: every rank calls it; an error on any rank is raised on all of them."""
    error = None
    try:
        _load(chunks, path, spec, par)
    except ValueError as e:
        error = str(e)
    agree_on_errors(error)


def _load(chunks, path: str, spec: ModelSpec, par: Parallelism) -> None:
    from megatron.core import parallel_state as ps
    from safetensors import safe_open
    from tqdm import tqdm

    table = rules_for(spec.family, mtp=spec.mtp)
    d, shapes = spec.dims, spec.hf_shapes
    where = index_safetensors(path)
    tp, tp_rank = par.tp, ps.get_tensor_model_parallel_rank()
    etp, etp_rank = par.expert_tp, (ps.get_expert_tensor_parallel_rank() if d.num_experts else 0)
    params = named_parameters_global(chunks)
    show = not dist.is_initialized() or dist.get_rank() == 0
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles = {}
        for mname, p in tqdm(params.items(), desc=f"load {Path(path).name}", disable=not show, unit="tensor"):
            if table.tied and mname == "output_layer.weight":
                # PP>1 keeps a copy of the tied embedding on the last stage
                rule, site = table.match("embedding.word_embeddings.weight")
            else:
                rule, site = table.match(mname)
            size, rank = (etp, etp_rank) if rule.expert else (tp, tp_rank)
            pieces = []
            for hf_name in rule.hf_names(site, d.num_layers):
                if hf_name not in where:
                    raise ValueError(
                        f"hf_path {path}: missing tensor {hf_name} (expected shape {shapes.get(hf_name)}, "
                        f"for {mname}, trainer {par.describe()})"
                    )
                f = where[hf_name]
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
                sl = handles[f].get_slice(hf_name)
                got, want = tuple(sl.get_shape()), shapes[hf_name]
                if got != want:
                    raise ValueError(f"tensor {hf_name}: shape {got} != expected {want} (trainer {par.describe()})")
                pieces.append(_tp_slice(sl, want, rule, size, rank, d.vocab_size))
            local = rule.transform.to_megatron(pieces, d)
            if tuple(local.shape) != tuple(p.shape):
                raise ValueError(
                    f"tensor {mname}: built shard {tuple(local.shape)} != model shard {tuple(p.shape)} "
                    f"(trainer {par.describe()})"
                )
            p.copy_(local.to(device=p.device, dtype=p.dtype))
