"""Megatron distributed checkpoints (megatron-core `dist_checkpointing`, format `torch_dist`).

A torch_dist checkpoint stores every tensor under a *global* key with its global shape (each rank
writes the pieces it owns, torch.distributed.checkpoint underneath), so it loads at any TP/PP/VPP
layout that builds the same model: each rank asks for exactly its own shards. That is what makes it
the interchange format of Megatron training jobs, and why `--load-megatron-checkpoint` reads it.

Keys follow the layer spec that wrote them; the Transformer-Engine spec spells the fused norms
differently (`rules/te_spec.py`). Loading reads the checkpoint's key list first and asks for this
model's tensors under the checkpoint's spelling, so a TE-spec checkpoint loads into the local-spec
model built here (its `_extra_state` entries are not asked for); saving writes either spelling.

Directory layout, as Megatron-LM writes it (so a Megatron-LM `--load` can read the model part):

    <dir>/iter_0000012/            the distributed checkpoint (metadata.json, common.pt, *.distcp)
    <dir>/latest_checkpointed_iteration.txt    "12"

`resolve_dir` accepts either the root or one checkpoint directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from trainer_svc.actor.megatron.rules import te_spec
from weightsync.model_spec import ModelSpec

log = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"
#: the common-state entry weightsync adds (Megatron-LM ignores unknown common keys)
COMMON_KEY = "weightsync"
NAMES = ("megatron", "te", "local")


def resolve_dir(path: str | Path) -> Path:
    """The distributed checkpoint directory: `path` itself, or under a Megatron-LM save root the
    iteration its tracker file names."""
    p = Path(path)
    if (p / "metadata.json").is_file():
        return p
    tracker = p / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        sub = p / (text if text == "release" else f"iter_{int(text):07d}")
        if (sub / "metadata.json").is_file():
            return sub
        raise ValueError(
            f"load_megatron_checkpoint {p}: {TRACKER} names {text!r} but {sub} holds no "
            f"metadata.json (incomplete save?)"
        )
    raise ValueError(
        f"load_megatron_checkpoint {p}: neither a distributed checkpoint (metadata.json) nor a "
        f"Megatron-LM save directory ({TRACKER}); point it at one"
    )


def _sharded_entries(sd):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return [v for v in nested_values(sd) if isinstance(v, ShardedBase)]


def model_sharded_state_dict(chunks) -> dict:
    """The chunks' sharded state dicts as Megatron-LM nests them ('model', or 'model0', 'model1'
    ... per virtual stage); keys inside are the checkpoint's global keys."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def spellings(key: str, spec: ModelSpec) -> list[str]:
    """The keys one tensor may have in a torch_dist checkpoint, most likely first: megatron-core's own
    (the key the model built here produces), the TE spec's, the plain module name.

    They differ for the pre-MLP norm of a MoE layer: megatron-core's local spec maps every layer's
    norms to the fused TE spelling (`sharded_state_dict_keys_map`), so its MoE layers write
    `mlp.linear_fc1.layer_norm_weight`, while the TE spec keeps a separate TENorm there and writes
    `pre_mlp_layernorm.weight`. Dense layers agree under both specs."""
    local = te_spec.to_local(key)
    out = [key]
    for k in (te_spec.to_te(local, spec.dims), local):
        if k not in out:
            out.append(k)
    return out


def rename_keys(sd, names: str, spec: ModelSpec) -> None:
    """Respell every sharded key of `sd` in place: 'megatron' keeps megatron-core's keys, 'te' the
    Transformer-Engine spec's, 'local' the module names."""
    if names not in NAMES:
        raise ValueError(f"names={names!r}: choose one of {', '.join(NAMES)}")
    if names == "megatron":
        return
    for entry in _sharded_entries(sd):
        if te_spec.is_extra_state(entry.key):
            continue
        local = te_spec.to_local(entry.key)
        entry.key = te_spec.to_te(local, spec.dims) if names == "te" else local


def _match_checkpoint(sd, meta: dict, spec: ModelSpec, ckpt: Path) -> None:
    """Point every tensor of `sd` at the spelling the checkpoint uses (in place), and check its
    global shape; a ValueError names what is missing or misshapen. (megatron's own error for a
    missing key is a bare KeyError deep in torch.distributed.checkpoint's planner.)"""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for entry in _sharded_entries(sd):
        if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            continue
        tried = spellings(entry.key, spec)
        found = next((k for k in tried if k in meta), None)
        if found is None:
            raise ValueError(
                f"checkpoint {ckpt}: no tensor {' / '.join(map(repr, tried))}; is it a checkpoint of this model?"
            )
        entry.key = found
        if not isinstance(entry, ShardedTensor):
            continue  # a factory (SwiGLU fc1) builds its pieces from this key; its shape is checked by load
        have = tuple(getattr(meta[found], "global_shape", None) or meta[found].size)
        if have != tuple(entry.global_shape):
            hint = (
                " (the vocabulary is padded to a multiple of 128*TP: save and load at TPs that pad it alike)"
                if "word_embeddings" in found or "output_layer" in found
                else ""
            )
            raise ValueError(
                f"checkpoint {ckpt}: tensor {found!r} has global shape {have}, this model needs "
                f"{tuple(entry.global_shape)}{hint}"
            )


def _drop_extra_state(sd) -> None:
    """The local spec holds no TE `_extra_state`; any entry of that kind is not a weight to carry."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def walk(d):
        for k in list(d):
            v = d[k]
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, ShardedBase) and te_spec.is_extra_state(v.key):
                del d[k]

    walk(sd)


def _sync_save_strategy():
    """megatron's torch_dist format written synchronously in this process.

    megatron-core 0.16.1's own torch_dist saver (`TorchDistSaveShardedStrategy`) always goes through
    its async writer, which starts a `spawn` multiprocessing Manager (re-importing the launching
    script in a child) and forks writer processes; inside a service that is a second copy of the
    trainer and a hang when the script is not import-safe. The bytes on disk are the same
    torch.distributed.checkpoint files either way: here megatron's own translation to PyTorch
    sharded tensors is handed to `torch.distributed.checkpoint.save` with its plain file writer."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSave(SaveShardedStrategy):
        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, False)
            pyt = mcore_to_pyt_state_dict(flat, False)
            dcp.save(
                pyt,
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=MCoreSavePlanner(flatten_state_dict=False, can_run_decentralized_global_plan=False),
            )

    return SyncTorchDistSave("torch_dist", 1)


def save_torch_dist(
    chunks, directory: str | Path, spec: ModelSpec, *, iteration: int, version: int, names: str = "megatron"
) -> Path:
    """Collective: write the model weights as `<directory>/iter_{iteration:07d}` and then point the
    tracker file at it (rank 0, after every rank finished). Returns the checkpoint directory."""
    from megatron.core import dist_checkpointing

    root = Path(directory)
    ckpt = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = model_sharded_state_dict(chunks)
    # `_extra_state` entries are kept (the linear layers carrying them have the same names in every
    # spelling), so a Megatron-LM job that asks for them finds them
    rename_keys(sd, names, spec)
    # Megatron-LM's common entries; `weightsync` records what wrote it
    sd["iteration"] = iteration
    sd["checkpoint_version"] = 3.0
    sd[COMMON_KEY] = {"family": spec.family, "names": names, "version": version}
    dist_checkpointing.save(sd, str(ckpt), sharded_strategy=_sync_save_strategy())
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / (TRACKER + ".tmp")
        tmp.write_text(f"{iteration}\n")
        tmp.replace(root / TRACKER)
    dist.barrier()
    log.info("megatron torch_dist checkpoint saved: %s (%s names)", ckpt, names)
    return ckpt


def load_torch_dist(chunks, path: str | Path, spec: ModelSpec) -> dict:
    """Collective: fill the chunks' parameters from a torch_dist checkpoint written at any layout;
    returns the checkpoint's common state (iteration, what wrote it). A missing or misshapen tensor
    raises ValueError naming it, on every rank."""
    from megatron.core import dist_checkpointing

    from trainer_svc.actor.megatron.load import agree_on_errors

    error = ckpt = sd = None
    try:
        ckpt = resolve_dir(path)
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
        sd = model_sharded_state_dict(chunks)
        _drop_extra_state(sd)
        _match_checkpoint(sd, meta, spec, ckpt)
    except ValueError as e:
        error = str(e)
    # a tensor only one rank asks for may be missing there only: every rank raises, none waits
    agree_on_errors(error)
    loaded = dist_checkpointing.load(sd, str(ckpt))
    with torch.no_grad():
        for key, state in loaded.items():
            if key.startswith("model"):
                i = 0 if key == "model" else int(key[len("model") :])
                # strict=False: the local spec keeps no `_extra_state`, and only weights are loaded
                missing, unexpected = chunks[i].load_state_dict(state, strict=False)
                real_missing = [m for m in missing if not te_spec.is_extra_state(m)]
                if real_missing or unexpected:
                    raise ValueError(
                        f"checkpoint {ckpt}: model chunk {i} missing {real_missing[:5]}, unexpected {unexpected[:5]}"
                    )
    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    log.info("loaded megatron torch_dist checkpoint %s (iteration %s)", ckpt, common.get("iteration"))
    return common
